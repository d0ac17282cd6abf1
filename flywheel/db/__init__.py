"""flywheel's database: the models (``models``) and how to reach them (``session``)."""

from flywheel.db.models import (
    NAMING_CONVENTION,
    Base,
    Feedback,
    Generation,
    ModelVersion,
    Node,
    ScoredTrajectoryRow,
    SessionState,
    Trajectory,
    UTCDateTime,
    VersionTransition,
)
from flywheel.db.session import (
    DatabaseUnavailable,
    downgrade,
    insert_ignore,
    make_engine,
    make_session_factory,
    open_database,
    safe_url,
    upgrade,
    wait_for_db,
)

__all__ = [
    "NAMING_CONVENTION",
    "Base",
    "DatabaseUnavailable",
    "Feedback",
    "Generation",
    "ModelVersion",
    "Node",
    "ScoredTrajectoryRow",
    "SessionState",
    "Trajectory",
    "UTCDateTime",
    "VersionTransition",
    "downgrade",
    "insert_ignore",
    "make_engine",
    "open_database",
    "make_session_factory",
    "safe_url",
    "upgrade",
    "wait_for_db",
]
