"""The composition roots: the ``flywheel`` command line (:mod:`launch.cli`) and ``flywheel up``
(:mod:`launch.up`). They wire the kernel (``flywheel``) and the stages into processes, reaching
every stage and application by name; no library module imports this package.
"""
