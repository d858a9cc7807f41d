"""The compile cache: key.py (the one place the key is assembled, from named entries), stores.py
(the memory and disk stores), lookup.py (find a compiled value, store one), serialize.py (a
compiled value's disk form), cli.py (`tpu-inductor cache`), and AOTAutograd's cache glue
(aot_autograd.py)."""
