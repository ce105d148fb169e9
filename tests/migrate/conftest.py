from fixtures.scan_projects import project

__all__ = ["project"]
