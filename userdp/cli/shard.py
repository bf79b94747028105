"""``userdp shard INPUT ...``, ``userdp shard --demo OUT``, ``userdp shard --fortunes OUT`` and
``userdp shard verify DIR``.

One parser with two optional positionals keeps the forms unambiguous: ``verify`` as the first
positional selects verification (to shard a file literally named ``verify``, write ``./verify``).
Heavy imports happen inside the handler so ``userdp --help`` stays fast.
"""

from __future__ import annotations

import argparse

_SHARD_ONLY_FLAGS = (
    "user_column",
    "text_column",
    "out",
    "num_shards",
    "tokenizer",
    "max_examples_per_user",
    "format",
    "keep_text",
    "dataset_name",
    "demo",
    "demo_users",
    "fortunes",
    "fortunes_dir",
    "fortunes_split",
)


def _positive_int(flag: str):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {value!r}")
        return number

    return parse


def _verify(directory: str) -> int:
    from userdp.clients.shard_store import ShardStore

    with ShardStore(directory) as store:
        report = store.verify()
    print(
        f"{directory}: ok ({report.shards} shards, {report.users} users, "
        f"{report.examples} examples, {report.tokens} tokens)"
    )
    return 0


def _handle(args: argparse.Namespace) -> int:
    defaults = {
        "format": "auto",
        "keep_text": False,
        "demo_users": 400,
        "fortunes_split": "private",
    }
    if args.target == "verify":
        if args.directory is None:
            raise ValueError("usage: userdp shard verify DIR (DIR is missing)")
        given = [
            f"--{name.replace('_', '-')}"
            for name in _SHARD_ONLY_FLAGS
            if getattr(args, name) not in (None, defaults.get(name))
        ]
        if given:
            raise ValueError(f"shard verify DIR takes no other options; remove {', '.join(given)}")
        return _verify(args.directory)
    if args.directory is not None:
        raise ValueError(
            f"unexpected second argument {args.directory!r}; use 'userdp shard INPUT --out DIR' "
            "or 'userdp shard verify DIR'"
        )

    from userdp.shards.tokenization import parse_tokenizer_spec
    from userdp.shards.writer import ShardOptions, write_shards

    parse_tokenizer_spec(args.tokenizer or "byte")  # fail before reading any input

    options = ShardOptions(
        num_shards=args.num_shards or (4 if args.demo or args.fortunes else 8),
        tokenizer=args.tokenizer or "byte",
        max_examples_per_user=args.max_examples_per_user,
        keep_text=args.keep_text,
        dataset_name=args.dataset_name,
        progress=not args.quiet,
    )
    if args.demo is not None and args.fortunes is not None:
        raise ValueError("--demo and --fortunes each write a corpus; pass one of them")
    if args.fortunes is None and (
        args.fortunes_dir is not None or args.fortunes_split != "private"
    ):
        raise ValueError("--fortunes-dir and --fortunes-split go with --fortunes OUT")
    if args.fortunes is not None:
        if args.target is not None or args.out is not None:
            raise ValueError("--fortunes OUT writes the fortunes corpus; drop INPUT and --out")
        from userdp.shards.fortunes import FORTUNES_DIR, fortunes_corpus
        from userdp.shards.input import InputSource

        table = fortunes_corpus(args.fortunes_dir or FORTUNES_DIR, args.fortunes_split)
        name = args.dataset_name or f"fortunes-{args.fortunes_split}"
        source = InputSource.from_table(table, "user_id", "text", name)
        summary = write_shards(source, args.fortunes, options)
        print(summary.format())
        return 0
    if args.demo is not None:
        if args.target is not None or args.out is not None:
            raise ValueError("--demo OUT writes the demo corpus; drop INPUT and --out")
        from userdp.shards.demo import demo_corpus
        from userdp.shards.input import InputSource

        name = f"userdp-demo-{args.demo_users}users"
        source = InputSource.from_table(demo_corpus(args.demo_users), "user_id", "text", name)
        summary = write_shards(source, args.demo, options)
        print(summary.format())
        return 0
    missing = [
        flag
        for flag, value in (
            ("INPUT", args.target),
            ("--user-column", args.user_column),
            ("--text-column", args.text_column),
            ("--out", args.out),
        )
        if value is None
    ]
    if missing:
        raise ValueError(
            f"userdp shard needs {', '.join(missing)} (or --demo OUT, --fortunes OUT, or verify DIR)"
        )
    from userdp.shards.input import open_input

    source = open_input(args.target, args.format, args.user_column, args.text_column)
    summary = write_shards(source, args.out, options)
    print(summary.format())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "shard",
        help="tokenize a user-partitioned dataset into Arrow shards, or verify shards",
        description=(
            "userdp shard INPUT --user-column C --text-column C --out DIR [options]\n"
            "userdp shard --demo OUT        write the embedded synthetic corpus as shards\n"
            "userdp shard --fortunes OUT    write the fortunes corpus (quotations by author)\n"
            "userdp shard verify DIR        check shards against the manifest"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", nargs="?", metavar="INPUT|verify", help="input file or directory")
    parser.add_argument("directory", nargs="?", metavar="DIR", help="shard directory (verify)")
    parser.add_argument("--user-column", help="column holding the user id (the privacy unit)")
    parser.add_argument("--text-column", help="column holding the example text")
    parser.add_argument("--out", help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--num-shards", type=_positive_int("--num-shards"), help="number of shards (default 8)"
    )
    parser.add_argument(
        "--tokenizer", help="byte (default), bpe:N (train on the input), or a local tokenizer dir"
    )
    parser.add_argument(
        "--max-examples-per-user",
        type=_positive_int("--max-examples-per-user"),
        help="keep only each user's first K examples (input order); off by default: "
        "contribution bounding belongs to the strategy",
    )
    parser.add_argument(
        "--format",
        default="auto",
        choices=("auto", "parquet", "jsonl", "csv", "arrow"),
        help="input format (default: from the file suffix)",
    )
    parser.add_argument("--keep-text", action="store_true", help="also store the raw text column")
    parser.add_argument(
        "--dataset-name", help="name recorded in the manifest (default: input stem)"
    )
    parser.add_argument("--demo", metavar="OUT", help="write the embedded demo corpus to OUT")
    parser.add_argument(
        "--demo-users", type=_positive_int("--demo-users"), default=400, help="demo corpus users"
    )
    parser.add_argument(
        "--fortunes",
        metavar="OUT",
        help="write the fortunes corpus to OUT: real quotations, one user per author "
        "(Debian: apt-get install fortunes)",
    )
    parser.add_argument(
        "--fortunes-dir",
        metavar="DIR",
        help="fortune data files (default /usr/share/games/fortunes)",
    )
    parser.add_argument(
        "--fortunes-split",
        choices=("private", "public"),
        default="private",
        help="private: attributed quotations by author (default); public: the unattributed "
        "ones, for non-private pre-training",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(handler=_handle)
