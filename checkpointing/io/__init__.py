"""Bytes in an object store: fsspec with tenacity's retries (``storage``), local folders reached without following
links (``localfs``, ``confine``), bounded reads of untrusted files (``untrusted``), hashing and the URL protocols
this product reaches."""
