"""Model weights: the lossless delta codec, the object store and the version registry.

Subpackages and modules: :mod:`.codec` (pure; hashing a state imports no JIT compiler, see its map),
:mod:`.store` (object storage), :mod:`.registry` (versions in the database), :mod:`.cli`
(``flywheel weights ...``). Nothing is re-exported here: import a name from the module that
defines it.
"""
