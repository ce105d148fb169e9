from allowlist_support import project

__all__ = ["project"]
