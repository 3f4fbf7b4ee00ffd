"""``gem-train data convert SOURCE OUT_DIR``: a built-in source's training data as Parquet for the ``parquet`` source.

The converter writes ``OUT_DIR/train.parquet`` and ``OUT_DIR/source.yaml``, the ``data.source`` entry
that reads it back (paste it into a run config, or load it with :func:`source_ref`). Training from
that entry gives the losses of the original source, step for step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gem_model.data.parquet_schema import ParquetDataError

if TYPE_CHECKING:
    import torch

SOURCE_FILE = "source.yaml"
DATA_FILE = "train.parquet"


def _arrow_list(values: torch.Tensor, lengths: torch.Tensor, value_type: Any) -> Any:
    import pyarrow as pa
    import torch

    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets.numpy()), pa.array(values.numpy()).cast(value_type))


def convert_movielens_1m(
    out_dir: Path, options: dict[str, Any], *, row_group_size: int = 1024, advance: Callable[[int], None] | None = None
) -> Path:
    """Write the training split of ``movielens_1m`` with ``options`` (its source options) as Parquet.

    Each user is one row, in user order: the whole training history (``max_len`` is applied when the
    copy is read, as the original does), its ratings as actions, its rating times, the request time
    (the time of the item that follows the history) and, with ``side_features``, the user attributes
    and the genre bag. Returns the path of ``source.yaml``.
    """
    import torch

    from gem_model.data.movielens import USER_FEATURES, MovieLensConfig, MovieLensSource
    from gem_model.data.parquet import import_pyarrow

    pa = import_pyarrow()
    config = MovieLensConfig(**options)
    if config.negatives != "uniform":
        raise ParquetDataError(
            f"movielens_1m option negatives={config.negatives!r}: the parquet source draws its negatives uniformly "
            "over the items; convert with negatives=uniform"
        )
    whole = MovieLensSource(config.model_copy(update={"max_len": 1 << 40}))  # every training event
    original = MovieLensSource(config)  # its pooled features: the genre bag looks at the cut history
    spec = original.feature_spec()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / DATA_FILE
    pooled_names = [p.name for p in spec.pooled]
    writer = None
    try:
        for users in torch.arange(whole.num_users).split(row_group_size):
            none = torch.empty(users.numel(), 0, dtype=torch.long)
            b = whole._batch(users, "train", none, sample_ids=users)
            side = original._batch(users, "train", none, sample_ids=users).pooled if pooled_names else None
            lengths = b.history_lengths()
            columns: dict[str, Any] = {
                "user": pa.array(users.numpy()),
                "history_length": pa.array(lengths.int().numpy()),
                "history_item": _arrow_list(b.sequence["seq_item"].values(), lengths, pa.int32()),
                "history_action": _arrow_list(b.sequence["seq_action"].values(), lengths, pa.int8()),
                "history_time": _arrow_list(b.timestamps, lengths, pa.int64()),
                "request_time": pa.array(b.request_times.numpy()),
            }
            for name in pooled_names:
                jt = side[name]
                if name in USER_FEATURES:
                    columns[name] = pa.array(jt.values().int().numpy())
                else:
                    columns[name] = _arrow_list(jt.values(), jt.lengths(), pa.int32())
            table = pa.table(columns)
            if writer is None:
                writer = pa.parquet.ParquetWriter(path, table.schema, compression="zstd", write_page_checksum=True)
            writer.write_table(table, row_group_size=row_group_size)
            if advance is not None:
                advance(users.numel())
    finally:
        if writer is not None:
            writer.close()
    entry = {
        "name": "parquet",
        "options": {
            "path": str(path.resolve()),
            "num_items": spec.num_items,
            "num_actions": spec.num_actions,
            "max_len": config.max_len,
            "seed": config.seed,
            "shuffle": "rows",  # the permutation movielens_1m draws
            "num_negatives": config.num_negatives,
            "negatives_per": config.negatives_per,
            "columns": {"history_length": "history_length"},
            "pooled": [
                {"feature": p.name, "column": p.name, "num_embeddings": p.num_embeddings, "pooling": p.pooling}
                for p in spec.pooled
            ],
        },
    }
    target = out_dir / SOURCE_FILE
    header = f"# data.source for the Parquet copy of movielens_1m (written by gem-train data convert); options {options}\n"
    target.write_text(header + yaml.safe_dump(entry, sort_keys=False))
    return target


CONVERTERS: dict[str, Callable[..., Path]] = {"movielens_1m": convert_movielens_1m}


def source_ref(out_dir: Path) -> dict[str, Any]:
    """The ``data.source`` entry a conversion wrote into ``out_dir``."""
    return yaml.safe_load((out_dir / SOURCE_FILE).read_text())


def num_rows(options: dict[str, Any], source: str) -> int:
    """Rows the conversion of ``source`` will write (for a progress display)."""
    if source == "movielens_1m":
        from gem_model.data.movielens import MovieLensConfig, MovieLensSource

        return MovieLensSource(MovieLensConfig(**options)).num_users
    raise KeyError(source)


# ------------------------------------------------------------------------------------------------- CLI


def add_data_parser(sub: Any) -> None:
    """``gem-train data convert SOURCE OUT_DIR [key=value ...]``."""
    data = sub.add_parser("data", help="data tools: convert a built-in source to Parquet")
    tools = data.add_subparsers(dest="data_command", required=True)
    convert = tools.add_parser("convert", help="write a built-in source's training data as Parquet for the parquet source")
    convert.add_argument("source", choices=sorted(CONVERTERS), help="the source to convert")
    convert.add_argument("out_dir", type=Path, help="folder for train.parquet and source.yaml")
    convert.add_argument("options", nargs="*", metavar="key=value", help="the source's options (YAML values)")
    convert.add_argument("--row-group-size", type=int, default=1024, help="rows per Parquet row group")
    convert.set_defaults(data_handler=cmd_data_convert)


def parse_options(pairs: list[str]) -> dict[str, Any]:
    from gem_model.errors import ConfigError

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError([("data convert options", pair, "expected key=value")])
        out[key] = yaml.safe_load(value)
    return out


def cmd_data_convert(args: Any) -> int:
    from pydantic import ValidationError

    from gem_model.errors import ConfigError
    from gem_model.train.progress import task_progress

    options = parse_options(args.options)
    if args.row_group_size < 1:
        raise ConfigError([("--row-group-size", args.row_group_size, "must be at least 1")])
    try:
        rows = num_rows(options, args.source)
        with task_progress(rows, f"convert {args.source}", unit="row") as advance:
            target = CONVERTERS[args.source](args.out_dir, options, row_group_size=args.row_group_size, advance=advance)
    except ValidationError as exc:
        problems = [(f"{args.source} option {'.'.join(map(str, e['loc']))}", e.get("input"), e["msg"]) for e in exc.errors()]
        raise ConfigError(problems) from None
    except ValueError as exc:
        if isinstance(exc, ParquetDataError):
            raise
        raise ConfigError([(f"{args.source} options", options, str(exc))]) from None
    print(f"wrote {rows} rows to {args.out_dir / DATA_FILE}; its data.source entry: {target}")
    return 0
