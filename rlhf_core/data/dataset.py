"""`data.task: dataset`: prompts from any table the `datasets` library reads.

A path may be a parquet, JSON or JSONL (or CSV / Arrow) file, a directory written by `save_to_disk` (a
Dataset, or a DatasetDict whose split is chosen by data.train_split / data.eval_split), another local
directory of data files, or a Hugging Face hub id (loaded with the split, where the machine has hub access).
verl's parquet schema loads as it is (`prompt` a chat list, `reward_model.ground_truth` the answer, every
other column in `Prompt.meta`); any other table maps its columns with data.prompt_key /
answer_key. Rows become Prompts through `rlhf_core.data.rows.row_to_prompt`, the code path JSONL uses, so
errors name the file, the row (0-based, as `dataset[i]`), the missing key and the keys found.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from rlhf_core.data.errors import DatasetError
from rlhf_core.data.prompts import Prompt
from rlhf_core.data.rows import RowKeys, prompts_from_rows

FILE_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it."""

INSTALL_HINT = "pip install 'asynctensorrlhf[data]' (or pip install datasets)"


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"data.task 'dataset' reads files with the `datasets` library: {INSTALL_HINT}") from None
    datasets.disable_progress_bars()
    return datasets


def _looks_local(path: str) -> bool:
    """A path that names a local file or folder (so a missing one is reported as missing, not looked up on
    the hub): absolute, relative with ./ or ~, or ending in a data-file suffix."""
    return path.startswith(("/", "./", "../", "~", "\\")) or Path(path).suffix.lower() in FILE_FORMATS


def _pick_split(loaded, label: str, split: str):
    """A Dataset out of what load_from_disk returned (a Dataset, or a DatasetDict by split)."""
    if not hasattr(loaded, "keys"):
        return loaded
    if split not in loaded:
        raise DatasetError(
            f"{label} holds the splits {sorted(loaded.keys())}, not {split!r}; set data.train_split / "
            "data.eval_split to one of them"
        )
    return loaded[split]


def read_dataset(path: str | Path, split: str = "train", limit: Optional[int] = None):
    """(the `datasets.Dataset`, its label for messages) for a file, a saved directory, a data folder or a hub
    id; `limit` keeps the first rows only. Raises DatasetError naming the path and what to do."""
    datasets = _datasets()
    text = str(path)
    p = Path(text).expanduser()
    try:
        if p.is_dir():
            label = str(p)
            if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
                ds = _pick_split(datasets.load_from_disk(str(p)), label, split)
            else:  # a folder of data files, laid out the way load_dataset finds its splits
                ds = datasets.load_dataset(str(p), split=split)
        elif p.is_file():
            label = str(p)
            fmt = FILE_FORMATS.get(p.suffix.lower())
            if fmt is None:
                raise DatasetError(
                    f"{p}: unknown data file type {p.suffix!r}; data.task 'dataset' reads "
                    f"{', '.join(sorted(FILE_FORMATS))} files and directories written by save_to_disk"
                )
            ds = datasets.load_dataset(fmt, data_files=str(p), split="train")
        elif _looks_local(text):
            raise DatasetError(f"dataset {p} does not exist")
        else:
            label = f"{text} (split {split!r})"
            ds = datasets.load_dataset(text, split=split)
    except DatasetError:
        raise
    except Exception as exc:  # datasets raises many types (ValueError, ArrowInvalid, DatasetGenerationError ...)
        cause = exc.__cause__ or exc
        raise DatasetError(
            f"{text}: `datasets` could not read it ({type(cause).__name__}: {str(cause)[:300]}). Give a parquet, "
            "JSON or JSONL file, a directory written by save_to_disk, or a hub id reachable from this machine"
        ) from None
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    return ds, label


def iter_rows(ds, label: str) -> Iterator[tuple[str, dict, dict]]:
    """(where, row, extra meta) for every row: where is '<label>, row <i>' (0-based, as ds[i])."""
    for i, row in enumerate(ds):
        yield f"{label}, row {i}", row, {}


def load_dataset_prompts(
    path: str | Path,
    tokenizer,
    keys: RowKeys,
    system_prompt: str = "",
    max_prompt_tokens: Optional[int] = None,
    *,
    split: str = "train",
    limit: Optional[int] = None,
) -> list[Prompt]:
    """Read `path` with `datasets` (`read_dataset`) and turn each row into a Prompt (`row_to_prompt`)."""
    ds, label = read_dataset(path, split, limit)
    return prompts_from_rows(iter_rows(ds, label), label, tokenizer, keys, system_prompt, max_prompt_tokens)
