"""The exceptions KMesh raises for problems a user can fix.

Every message says what was wrong and what to do about it; the CLI prints it without a traceback.
"""


class KMeshError(Exception):
    """Base class for errors caused by input or environment, not by a bug in KMesh."""


class InvalidRequestError(KMeshError):
    """A request's prompt or sampling parameters cannot be served as given."""


class ModelNotFoundError(KMeshError):
    """A model folder, file or package that was asked for is not there."""


class ModelNotSupportedError(KMeshError):
    """A model KMesh cannot run exactly as its engine would (a family, scaling or mechanism it
    does not implement): refused at load, never run approximately."""


class OutOfBlocksError(KMeshError):
    """The KV block pool is too small for a request even when it runs alone."""


class ContractError(KMeshError):
    """Declared state relationships (segments, families, forks) are inconsistent."""


class DependencyError(KMeshError):
    """An optional dependency (a pip extra) that a command needs is not installed, or is a
    version KMesh was not tested with."""
