"""Weights packed in place: several parameters made consecutive row slices
of one tensor, without a second copy of them.

    pack_siblings([wq, wk, wv])  # one [Nq+Nk+Nv, K] tensor; each .data a row slice
    packed_view([wq, wk, wv])    # that tensor (a view), or None when not packed

`pack_siblings` allocates the packed tensor once, copies each tensor in and
rebinds each one's `.data` to its row slice: the objects, shapes, strides,
dtypes and values stay, their old storage is freed (when nothing else holds
it), and an in-place update (`load_state_dict`, `copy_`) writes the packed
tensor itself. Row slices of a row-major tensor are contiguous, with the
strides of a tensor of their own, so nothing that checks shapes or strides
(Dynamo's guards included) sees a change. docs/design.md, section "Sibling
linears".
"""

from __future__ import annotations

import torch


def _rows_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))


def packed_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum N_i, *rest] tensor of which `tensors` are the consecutive row
    slices, in order, or None when they are not laid out that way."""
    if not tensors:
        return None
    first = tensors[0]
    rest = tuple(first.shape[1:])
    try:
        base = first.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a subclass, a fake)
        return None
    offset = first.storage_offset()
    for t in tensors:
        if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype != first.dtype
                or t.device != first.device or tuple(t.shape[1:]) != rest
                or not t.is_contiguous() or t.untyped_storage().data_ptr() != base
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *rest)
    return first.as_strided(shape, _rows_strides(shape), first.storage_offset())


def _capturing() -> bool:
    """A CUDA graph capture or a dispatch mode (the CPU stand-in's capture, a
    fake mode) is active: no allocation or rebinding may happen now."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def can_pack(tensors: list[torch.Tensor]) -> str | None:
    """Why `pack_siblings(tensors)` would not pack them (None: it would, or
    they already are packed)."""
    if packed_view(tensors) is not None:
        return None
    first = tensors[0]
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return f"a {type(t).__name__} is not a plain tensor or parameter"
        if t.device.type == "meta" or t.dtype != first.dtype or t.device != first.device:
            return "the tensors differ in dtype or device, or are on the meta device"
        if tuple(t.shape[1:]) != tuple(first.shape[1:]):
            return "the tensors differ in shape past the first dimension"
        # Sole owner of its storage: then rebinding frees it (a view of a larger
        # tensor would keep that alive, and the weights would take more memory).
        if (not t.is_contiguous() or t.storage_offset() != 0
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            return "a tensor is a view into a larger storage"
    return None


def pack_siblings(tensors: list[torch.Tensor]) -> str:
    """Make `tensors` consecutive row slices of one new tensor, in place (see
    the module docstring). Returns what happened: "packed", "already packed",
    or "not packed: <why>" (then the op runs its unpacked path)."""
    if packed_view(tensors) is not None:
        return "already packed"
    why = can_pack(tensors)
    if why is None and _capturing():
        why = "a graph capture or dispatch mode is active"
    if why is None and len({id(t) for t in tensors}) != len(tensors):
        why = "the same tensor twice"
    if why is not None:
        return f"not packed: {why}"
    first = tensors[0]
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    with torch.no_grad():
        packed = torch.empty(shape, dtype=first.dtype, device=first.device)
        row = 0
        for t in tensors:
            n = t.shape[0]
            packed[row:row + n].copy_(t)
            t.data = packed[row:row + n]  # same object, shape, strides, values
            row += n
    return "packed"
