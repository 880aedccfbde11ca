"""Object storage (S3 and S3-compatible endpoints, ``msc://`` profiles) for checkpoints.

Imports only the standard library here; boto3 is loaded when a URL is first used.
"""
from .client import ObjectInfo, ObjectStore
from .url import ObjectURL, check_object_name, child, is_object_url, parse_url

__all__ = ["ObjectInfo", "ObjectStore", "ObjectURL", "check_object_name", "child", "is_object_url", "parse_url"]
