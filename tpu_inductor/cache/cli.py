"""`tpu-inductor cache stats | ls | clear | explain A B`: the persistent compile cache seen from
the command line (never created by these commands: they only read or remove)."""

from __future__ import annotations

import time

from tpu_inductor.cache import stores
from tpu_inductor.config import Options


def add_subcommands(commands) -> None:
    """Add the `cache` command group to the `tpu-inductor` parser."""
    parser = commands.add_parser("cache", help="inspect or clear the persistent compile cache")
    parser.add_argument(
        "--dir", help="cache directory (default: TPU_INDUCTOR_CACHE_DIR or the user cache)"
    )
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("stats", help="entries, total size and the size cap").set_defaults(
        run=_cli_stats
    )
    actions.add_parser("ls", help="list entries, least recently used first").set_defaults(
        run=_cli_ls
    )
    actions.add_parser("clear", help="remove every entry").set_defaults(run=_cli_clear)
    explain = actions.add_parser("explain", help="which key entries differ between two entries")
    explain.add_argument("key_a")
    explain.add_argument("key_b")
    explain.set_defaults(run=_cli_explain)


def _cli_cache(args) -> stores.DiskCache:
    """The cache the command names; never created (these commands only read or remove)."""
    options = Options.from_user()
    directory = args.dir if args.dir is not None else options.cache_dir
    return stores.open_disk_cache(directory, options.cache_max_mb, create=False)


def _cli_stats(args) -> int:
    disk = _cli_cache(args)
    entries = disk.entries()
    total = sum(e.size for e in entries)
    print(f"directory: {disk.directory}")
    print(f"entries:   {len(entries)}")
    print(f"size:      {total / 2**20:.1f} MiB of {disk.max_bytes / 2**20:.0f} MiB")
    leftovers = disk.leftovers()
    if leftovers:
        size = sum(f.stat().st_size for p in leftovers for f in p.rglob("*") if f.is_file())
        print(
            f"leftovers: {len(leftovers)} temporary directories of interrupted writes, "
            f"{size / 2**20:.1f} MiB (removed by the next store or `cache clear`)"
        )
    return 0


def _cli_ls(args) -> int:
    for entry in _cli_cache(args).entries():
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.last_used))
        print(f"{entry.digest[:16]}  {entry.size / 1024:9.1f} KiB  {used}  {entry.label}")
    return 0


def _cli_clear(args) -> int:
    disk = _cli_cache(args)
    print(f"removed {disk.clear()} entries from {disk.directory}")
    return 0


def _cli_explain(args) -> int:
    disk = _cli_cache(args)
    key_a, key_b = disk.key_of(args.key_a), disk.key_of(args.key_b)
    differ = key_a.explain(key_b)
    if not differ:
        print("the keys are equal")
    for name in differ:
        a, b = dict(key_a.entries).get(name, "-"), dict(key_b.entries).get(name, "-")
        print(f"{name}: {a[:16]} != {b[:16]}")
    return 0
