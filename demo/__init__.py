"""The demo: ``flywheel demo`` (:mod:`demo.run`), its simulated users (:mod:`demo.users`) and the
tiny model they talk to (:mod:`demo.tinymodel`), the default when ``model.path`` is empty.

An application over the kernel, not part of it: no kernel or stage module imports this package
(the command line names what it needs by string).
"""
