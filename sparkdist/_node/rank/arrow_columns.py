"""Arrow columns as tensors, row by row: the column types a DataFrame input may have (numbers,
arrays of numbers, Spark ML vectors) and one converter factory per type. Shared by
``sparkdist.data``'s datasets and the sharded loader (``shard_loader``).
"""

from __future__ import annotations

from typing import Any


def converter(name: str, arrow_type: Any) -> Any:
    """A factory (array, float_dtype) -> (row index -> tensor) for one column's type."""
    import pyarrow as pa

    if (
        pa.types.is_integer(arrow_type)
        or pa.types.is_floating(arrow_type)
        or (pa.types.is_boolean(arrow_type))
    ):
        return _scalars
    if (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    ):
        inner = arrow_type.value_type
        if pa.types.is_integer(inner) or pa.types.is_floating(inner):
            return _arrays
    if pa.types.is_struct(arrow_type) and {f.name for f in arrow_type} >= {
        "type",
        "size",
        "indices",
        "values",
    }:
        return _ml_vectors
    raise ValueError(
        f"column {name!r} has type {arrow_type}, which cannot become a tensor; select "
        "numeric, array or ML vector columns (convert or drop this one with Spark first)"
    )


def _scalars(array: Any, float_dtype: Any) -> Any:
    import numpy as np
    import torch

    values = array.to_numpy(zero_copy_only=False)
    floating = np.issubdtype(values.dtype, np.floating)

    def get(i: int) -> Any:
        tensor = torch.as_tensor(values[i])
        return tensor.to(float_dtype) if floating else tensor

    return get


def _arrays(array: Any, float_dtype: Any) -> Any:
    import numpy as np
    import torch

    offsets = array.offsets.to_numpy() if hasattr(array, "offsets") else None
    flat = array.flatten().to_numpy(zero_copy_only=False)  # this slice's values only
    width = getattr(array.type, "list_size", None)
    floating = np.issubdtype(flat.dtype, np.floating)

    def get(i: int) -> Any:
        if offsets is None:  # fixed-size lists: the type gives the width
            assert width is not None
            piece = flat[i * width : (i + 1) * width]
        else:
            piece = flat[offsets[i] - offsets[0] : offsets[i + 1] - offsets[0]]
        tensor = torch.as_tensor(np.array(piece))
        return tensor.to(float_dtype) if floating else tensor

    return get


def _ml_vectors(array: Any, float_dtype: Any) -> Any:
    import torch

    kinds = array.field("type").to_pylist()
    sizes = array.field("size").to_pylist()
    indices = array.field("indices")
    values = array.field("values")

    def get(i: int) -> Any:
        vector_values = torch.tensor(values[i].as_py() or [], dtype=float_dtype)
        if kinds[i] == 1:  # dense
            return vector_values
        dense = torch.zeros(int(sizes[i]), dtype=float_dtype)
        positions = torch.tensor(indices[i].as_py() or [], dtype=torch.long)
        dense[positions] = vector_values
        return dense

    return get
