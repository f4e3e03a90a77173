"""``dadfl.data_files`` — a site's data file read into a :class:`~dadfl.workloads.Split`.

The formats a gRPC site's ``data.path`` / ``evaluation.path`` and a Flower node's ``data-path``
accept: ``.npz`` (numpy arrays ``inputs`` and ``targets``, read without pickle), ``.pt`` (a dict
of tensors, ``weights_only``) and ``.csv`` (a header row, numeric columns, whole-number class
labels in ``target_column``). A file is hostile until read: every problem is one
:class:`DataMismatch` naming the config field, the file and the fix, never a value.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import numpy as np
import torch

from dadfl.sanitize import printable
from dadfl.workloads import Split


class DataMismatch(ValueError):
    """The site's data does not fit the coordinator's model; the message says where and how to fix it."""


def read_data_file(path: Path, target_column: str = "target", field: str = "data.path") -> Split:
    """``inputs``/``targets`` from a .npz (numpy arrays), .pt (dict of tensors) or .csv file; every
    problem is one :class:`DataMismatch` naming ``field`` and the fix, never a value."""
    where = f"{field} {path}"
    if path.suffix not in (".npz", ".pt", ".csv"):
        raise DataMismatch(f"{where}: use a .npz or .pt file holding 'inputs' and 'targets', or a .csv file")
    if not path.is_file():
        raise DataMismatch(f"{where} does not exist; point {field} in the site config at this site's data file")
    if path.suffix == ".csv":
        return read_csv(path, target_column, field)
    try:
        if path.suffix == ".npz":
            with np.load(path) as arrays:  # allow_pickle stays off: a data file runs no code
                data = {k: arrays[k] for k in arrays.files}
        else:
            data = torch.load(path, weights_only=True)
    except Exception as exc:
        raise DataMismatch(f"{where}: cannot be read as {path.suffix} ({type(exc).__name__}); save it with numpy.savez or torch.save") from None
    if not isinstance(data, dict):
        raise DataMismatch(f"{where}: holds a {type(data).__name__}, not a dict with 'inputs' and 'targets'")
    missing = {"inputs", "targets"} - set(data)
    if missing:
        raise DataMismatch(f"{where}: missing {', '.join(sorted(missing))} (found {', '.join(map(str, sorted(data, key=str))) or 'nothing'})")
    tensors = {}
    for name in ("inputs", "targets"):
        value = data[name]
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "biufc":
                raise DataMismatch(f"{where}: {name} are {value.dtype} values, not numbers; save numeric arrays")
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor):
            raise DataMismatch(f"{where}: {name} is a {type(value).__name__}, not an array or tensor")
        tensors[name] = value
    if len(tensors["inputs"]) != len(tensors["targets"]):
        raise DataMismatch(f"{where}: {len(tensors['inputs'])} rows of inputs but {len(tensors['targets'])} of targets; they must match")
    return Split(tensors["inputs"], tensors["targets"])


def read_csv(path: Path, target_column: str, field: str) -> Split:
    """Features as float32, the ``target_column`` as int64 class labels. Read as spreadsheets
    export it: quoted fields, a UTF-8 byte-order mark, blank lines. A problem names its line
    and column, never a value."""
    with open(path, newline="", encoding="utf-8-sig") as file:
        header = [name.strip() for name in next(csv.reader([file.readline()]), [])]
        if target_column not in header:
            raise DataMismatch(f"{field} {path}: no column {target_column!r} in the header ({len(header)} columns); set data.target_column")
        try:
            with warnings.catch_warnings():  # no rows: the check below says so, in the site's words
                warnings.filterwarnings("ignore", message="loadtxt: input contained no data", category=UserWarning)
                table = np.loadtxt(file, delimiter=",", quotechar='"', dtype=np.float64, ndmin=2)
        except ValueError:  # numpy's message quotes the value: find the cell again, and name only where it is
            raise DataMismatch(f"{field} {path}: {_unreadable(path, header)}") from None
    if table.shape[0] == 0 or table.shape[1] != len(header):
        raise DataMismatch(
            f"{field} {path}: {table.shape[1]} values per row and {table.shape[0]} rows, against {len(header)} header "
            "columns: every row must have one value per header column, and there must be rows"
        )
    target = header.index(target_column)
    labels = table[:, target]
    if not np.array_equal(labels, np.round(labels)):
        raise DataMismatch(f"{field} {path}: column {target_column!r} must hold whole-number class labels")
    features = np.delete(table, target, axis=1).astype(np.float32)
    return Split(torch.from_numpy(features), torch.from_numpy(labels.astype(np.int64)))


def _unreadable(path: Path, header: list[str]) -> str:
    """Where a CSV that numpy could not read goes wrong: the first row of another width, or the
    first empty or non-numeric cell, by line and column (read again row by row: only on failure)."""
    with open(path, newline="", encoding="utf-8-sig") as file:
        reader = csv.reader(file)
        next(reader, None)
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                return (f"line {reader.line_num} has {len(row)} values against {len(header)} header columns: every row "
                        "must have one value per header column")
            for name, value in zip(header, row):
                if not value.strip():
                    return f"line {reader.line_num}, column {printable(name)} is empty: fill in or drop rows with missing values"
                try:
                    float(value)
                except ValueError:
                    return (f"line {reader.line_num}, column {printable(name)} is not a number: every value after the "
                            "header must be a number")
    return "every value after the header must be a number"
