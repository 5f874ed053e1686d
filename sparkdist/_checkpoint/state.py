"""State dicts in a loading rank's memory: what DCP's flattening loses and a load without a
template needs back, tensors moved where ``map_location`` says, and an old single file's state
put into a template.

DCP stores a state dict flattened: every dict key becomes a string (``optimizer.state_dict()``
keys its ``"state"`` by parameter index) and an empty dict leaves no entry (that ``"state"``
before the first step). A load into a template does not care (the template has the keys); a
load without one rebuilds from DCP's metadata, so the saving rank notes both in the commit
marker (``layout_notes``) and the loading rank puts them back (``restore_keys``). Keys of other
types (tuples, floats) come back as strings, as DCP makes them.

Non-goals: reading or writing files (``checkpoint_io``, ``checkpoint_layout``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sparkdist._checkpoint.layout import Unreadable

if TYPE_CHECKING:
    import torch

#: Paths into a state dict as DCP flattens it: str for a dict key, int for a list index.
Path = list[str | int]


def layout_notes(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a load without a template needs to rebuild ``state`` as it was: DCP turns every
    dict key into a string (``optimizer.state_dict()["state"]`` is keyed by int) and drops
    empty dicts (that ``"state"`` before the first step). Paths as DCP flattens them."""
    import torch

    int_keys: list[list[Any]] = []
    empty: list[Path] = []

    def terminal(values: list[Any]) -> bool:  # DCP's rule: such a list is saved whole
        return not any(
            isinstance(v, (Mapping, torch.Tensor)) or (isinstance(v, list) and not terminal(v))
            for v in values
        )

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            if not value:
                empty.append(path)
            ints = [k for k in value if type(k) is int]
            if ints:
                int_keys.append([path, ints])
            for key, item in value.items():
                visit([*path, str(key)], item)
        elif isinstance(value, list) and not terminal(value):
            for index, item in enumerate(value):
                visit([*path, index], item)

    for key, value in state.items():
        visit([str(key)], value)
    return {"int_keys": int_keys, "empty": empty}


def restore_keys(state: dict[str, Any], notes: Mapping[str, Any]) -> None:
    """Undo what ``layout_notes`` recorded, in place (paths that are not there are left)."""
    for path in notes.get("empty", []):
        _put_empty(state, path)
    for path, keys in sorted(notes.get("int_keys", []), key=lambda n: -len(n[0])):
        parent, last = _walk(state, path[:-1]), path[-1]
        if parent is None or not _has(parent, last) or not isinstance(parent[last], dict):
            continue
        ints = {str(k): k for k in keys}
        parent[last] = {ints.get(k, k): v for k, v in parent[last].items()}


def _walk(root: Any, path: Path) -> Any:
    for part in path:
        if not _has(root, part):
            return None
        root = root[part]
    return root


def _has(container: Any, part: str | int) -> bool:
    if isinstance(part, int):
        return isinstance(container, list) and 0 <= part < len(container)
    return isinstance(container, dict) and part in container


def _put_empty(root: dict[str, Any], path: Path) -> None:
    container: Any = root
    for part, following in zip(path, [*path[1:], None], strict=True):
        fresh: Any = {} if following is None or isinstance(following, str) else []
        if isinstance(part, int):
            if not isinstance(container, list):
                return
            container.extend([None] * (part + 1 - len(container)))
            if container[part] is None:
                container[part] = fresh
        elif isinstance(container, dict):
            container.setdefault(part, fresh)
        else:
            return
        container = container[part]


def move_tensors(state: Any, map_location: Any) -> Any:
    """Tensors read on the CPU, moved as ``map_location`` says (a dict maps from "cpu", a
    callable is called with location "cpu", as ``torch.load`` would for tensors saved there)."""
    import torch

    if map_location is None or (isinstance(map_location, str) and map_location == "cpu"):
        return state
    if isinstance(map_location, Mapping):
        target = map_location.get("cpu")
        if target is None:
            return state
        move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.to(target)
    elif isinstance(map_location, (str, torch.device)):
        move = lambda t: t.to(map_location)
    else:

        def move(t: torch.Tensor) -> torch.Tensor:
            storage = map_location(t.untyped_storage(), "cpu")
            if storage is None:
                return t
            moved = torch.empty(0, dtype=t.dtype, device=storage.device)
            return moved.set_(storage, t.storage_offset(), t.size(), t.stride())

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return move(value)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(v) for v in value)
        return value

    return walk(state)


def fill(into: dict[Any, Any], saved: Any, where: str = "") -> None:
    """An old single file's state into ``into``, as DCP would: tensors copied in place where
    the shapes match, state dicts into objects that load them, anything else replaced."""
    import torch
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.tensor import DTensor

    if not isinstance(saved, Mapping):
        raise Unreadable(f"it holds a {type(saved).__name__}, not a dict to load into")
    for key in list(into):
        if key not in saved:
            raise Unreadable(f'it has no entry "{where}{key}"')
        current, new = into[key], saved[key]
        if (
            isinstance(current, torch.Tensor)
            and not isinstance(current, DTensor)
            and isinstance(new, torch.Tensor)
            and current.shape == new.shape
        ):
            with torch.no_grad():
                current.copy_(new)
        elif isinstance(current, dict) and isinstance(new, Mapping):
            fill(current, new, f"{where}{key}.")
        elif isinstance(current, Stateful) and isinstance(new, Mapping):
            current.load_state_dict(dict(new))
        else:
            into[key] = new
