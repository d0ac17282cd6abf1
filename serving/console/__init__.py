"""The operator console: server-rendered pages under ``/console`` that show and steer the flywheel."""
