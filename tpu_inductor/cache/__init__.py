"""The compile cache: the key, the memory and disk stores, serialization of executables, the
compile stage through the cache, and AOTAutograd's cache glue."""
