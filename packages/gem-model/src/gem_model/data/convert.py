"""``gem-train data convert SOURCE OUT_DIR``: a built-in source's data as Parquet for the ``parquet`` source.

The converter writes, into ``OUT_DIR``:

- ``train.parquet``, and the held-out splits ``valid.parquet`` and ``test.parquet`` (one row per user
  with the history the split reads and its ``target``), all with page checksums (see below);
- ``source.yaml``: the ``data.source`` entry that reads them back (paste it into a run config, or load
  it with :func:`source_ref`);
- ``run.yaml``: a whole run config around that entry, with the model options the data needs (no
  candidate column: ``model.use_candidate: false``; ``model.max_seq_len`` as long as the histories):
  ``gem-train run -c OUT_DIR/run.yaml`` trains and evaluates as it is.

Training from that entry gives the losses of the original source, step for step, and its evaluation
the original's metrics. Page checksums: pyarrow writes none by default, and a damaged page without one
is read as whatever its bytes decode to (only the reader's checks on ids, nulls and times may catch
it); with them, the ``parquet`` source verifies every page it reads and names the damaged row group.
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
RUN_FILE = "run.yaml"
DATA_FILE = "train.parquet"
SPLIT_FILES = {"valid": "valid.parquet", "test": "test.parquet"}


def _arrow_list(values: torch.Tensor, lengths: torch.Tensor, value_type: Any) -> Any:
    import pyarrow as pa
    import torch

    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets.numpy()), pa.array(values.numpy()).cast(value_type))


def convert_movielens_1m(
    out_dir: Path, options: dict[str, Any], *, row_group_size: int = 1024, advance: Callable[[int], None] | None = None
) -> Path:
    """Write ``movielens_1m`` with ``options`` (its source options) as Parquet: the training split and
    the validation and test splits.

    Each user is one row, in user order: the whole history the split reads (``max_len`` is applied when
    the copy is read, as the original does), its ratings as actions, its rating times, the request time
    (as the source's ``request_time`` option says) and, with ``side_features``, the user attributes and
    the genre bag; the held-out splits add the ``target`` item (for the first ``max_eval_users`` users).
    Returns the path of ``source.yaml``.
    """
    import torch

    from gem_model.data.movielens import MovieLensConfig, MovieLensSource

    config = MovieLensConfig(**options)
    if config.negatives != "uniform":
        raise ParquetDataError(
            f"movielens_1m option negatives={config.negatives!r}: the parquet source draws its negatives uniformly "
            "over the items; convert with negatives=uniform"
        )
    whole = MovieLensSource(config.model_copy(update={"max_len": 1 << 40}))  # every event before the target
    original = MovieLensSource(config)  # its pooled features: the genre bag looks at the cut history
    spec = original.feature_spec()
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_split(out_dir / DATA_FILE, whole, original, "train", torch.arange(whole.num_users), row_group_size, advance)
    evaluated = torch.arange(original.evaluation.num_users)
    for split, name in SPLIT_FILES.items():
        _write_split(out_dir / name, whole, original, split, evaluated, row_group_size, advance)
    entry = {
        "name": "parquet",
        "options": {
            "path": str((out_dir / DATA_FILE).resolve()),
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
            "evaluation": {
                **{split: str((out_dir / name).resolve()) for split, name in SPLIT_FILES.items()},
                "target": "target",
                "exclude_seen": config.exclude_seen,
                "batch_size": config.eval_batch_size,
            },
        },
    }
    target = out_dir / SOURCE_FILE
    header = f"# data.source for the Parquet copy of movielens_1m (written by gem-train data convert); options {options}\n"
    target.write_text(header + yaml.safe_dump(entry, sort_keys=False))
    run = {
        "name": f"{out_dir.resolve().name}",
        "model": {"max_seq_len": config.max_len, "use_candidate": False, "use_side_features": bool(spec.pooled)},
        "data": {"source": entry},
    }
    (out_dir / RUN_FILE).write_text(
        f"# A run on the Parquet copy of movielens_1m, as it is: gem-train run -c {out_dir / RUN_FILE}\n"
        "# (the data has no candidate column, hence model.use_candidate: false; the model's sizes are the\n"
        "# defaults: configs/ml1m.yaml has the HSTU paper's, to combine with data.source from source.yaml)\n"
        + yaml.safe_dump(run, sort_keys=False)
    )
    return target


def _write_split(
    path: Path, whole: Any, original: Any, split: str, users: torch.Tensor, row_group_size: int,
    advance: Callable[[int], None] | None,
) -> None:  # fmt: skip
    """One split's rows (see :func:`convert_movielens_1m`), with page checksums."""
    import torch

    from gem_model.data.movielens import USER_FEATURES
    from gem_model.data.parquet import import_pyarrow

    pa = import_pyarrow()
    pooled_names = [p.name for p in original.feature_spec().pooled]
    writer = None
    try:
        for chunk in users.split(row_group_size):
            none = torch.empty(chunk.numel(), 0, dtype=torch.long)
            b = whole._batch(chunk, split, none, sample_ids=chunk)
            side = original._batch(chunk, split, none, sample_ids=chunk).pooled if pooled_names else None
            lengths = b.history_lengths()
            columns: dict[str, Any] = {
                "user": pa.array(chunk.numpy()),
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
            if split != "train":
                columns["target"] = pa.array(original.evaluation.targets(chunk, split).int().numpy())
            table = pa.table(columns)
            if writer is None:
                writer = pa.parquet.ParquetWriter(path, table.schema, compression="zstd", write_page_checksum=True)
            writer.write_table(table, row_group_size=row_group_size)
            if advance is not None:
                advance(chunk.numel())
    finally:
        if writer is not None:
            writer.close()


CONVERTERS: dict[str, Callable[..., Path]] = {"movielens_1m": convert_movielens_1m}


def source_ref(out_dir: Path) -> dict[str, Any]:
    """The ``data.source`` entry a conversion wrote into ``out_dir``."""
    return yaml.safe_load((out_dir / SOURCE_FILE).read_text())


def num_rows(options: dict[str, Any], source: str) -> int:
    """Rows the conversion of ``source`` will write, all splits (for a progress display)."""
    if source == "movielens_1m":
        from gem_model.data.movielens import MovieLensConfig, MovieLensSource

        original = MovieLensSource(MovieLensConfig(**options))
        return original.num_users + len(SPLIT_FILES) * original.evaluation.num_users
    raise KeyError(source)


# ------------------------------------------------------------------------------------------------- CLI


def add_data_parser(sub: Any) -> None:
    """``gem-train data convert SOURCE OUT_DIR [key=value ...]``."""
    data = sub.add_parser("data", help="data tools: convert a built-in source to Parquet")
    tools = data.add_subparsers(dest="data_command", required=True)
    convert = tools.add_parser(
        "convert", help="write a built-in source's data as Parquet for the parquet source, with a run config that reads it"
    )
    convert.add_argument("source", choices=sorted(CONVERTERS), help="the source to convert")
    convert.add_argument("out_dir", type=Path, help="folder for the .parquet files, source.yaml and run.yaml")
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
    print(f"wrote {rows} rows to {args.out_dir}: {DATA_FILE}, {', '.join(SPLIT_FILES.values())}")
    print(f"its data.source entry: {target}")
    print(f"train and evaluate on it as it is: gem-train run -c {args.out_dir / RUN_FILE}")
    return 0
