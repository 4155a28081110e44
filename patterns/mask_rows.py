"""A closed mask computation evaluated a block of query rows at a time, for masks too large to hold whole.

The causal-mask family proves a mask causal by evaluating its producers once at compile time
(patterns/causal_mask.py). At 128k tokens the mask alone is 16 GiB of bools and its producers hold several
such values; at 256k, 64 GiB. This module evaluates the same producers for rows ``[r0, r1)`` of the mask only,
so the proof holds at most one block of rows (``ROW_BLOCK_ELEMENTS`` elements of the mask) at a time.

Why a block of rows can be computed from the producers alone: the masks models build are *row-local*: the
mask's row i is a function of the query index i (and of values with no row dimension, such as the key
indices), computed by broadcasting elementwise ops. Walking back from the mask, each producer's dimension
that becomes the mask's row dimension is found (its *row dim*, or none when the value is broadcast along the
rows). Then, for a block of rows:

- a producer with no row dim is evaluated whole, once (such values are at most [..., 1, S]: small);
- a creation op with a row dim (``ones``, ``zeros``, ``full``, ``empty``) makes only the block's rows;
- a producer whose inputs have no row dim but which has one itself (``arange``: the query index) is
  evaluated whole and narrowed to the block (it is one row of T numbers, not T x S);
- any other producer runs on its inputs' blocks; ``expand`` gets the block's length in place of the row
  size, and ``tril`` / ``triu`` their diagonal shifted by ``r0`` (row i' of the block is row r0 + i').

Only ops whose row i depends on their inputs' row i alone are let through (elementwise ops and casts,
``where`` / ``masked_fill``, ``unsqueeze``, ``expand``, indexing with ``None`` and full slices, ``tril`` /
``triu`` on the last two dims); anything else (a reduction, a view that merges dims, a slice of the row dim,
a matmul) makes ``RowBlocks.build`` say why not, and the caller keeps its budget's reason.
"""
from __future__ import annotations

import operator
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx as fx

# The mask's elements one block holds (64M: 256 MiB of bools at 256k keys); a block's intermediates are a
# few values of this size.
ROW_BLOCK_ELEMENTS = 1 << 26

# A value of at most ROW_BLOCK_ELEMENTS / SMALL_SHARE elements is made whole and narrowed to each block, whatever
# computes it: the [B, T] ids and indices a mask is built from are, even at 256k tokens.
SMALL_SHARE = 8

_ELEMENTWISE = {"add", "sub", "mul", "le", "lt", "ge", "gt", "eq", "ne", "and_", "or_", "xor", "bitwise_and",
                "bitwise_or", "bitwise_xor", "logical_and", "logical_or", "logical_xor", "where", "masked_fill",
                "minimum", "maximum"}
_UNARY = {"to", "type", "bool", "float", "half", "bfloat16", "int", "long", "contiguous", "clone", "logical_not",
          "bitwise_not", "invert", "neg", "type_as", "detach", "cast"}
_CREATION = {"ones", "zeros", "full", "empty"}
_TRIANGLE = {"tril", "triu"}
# Creation from another tensor's dtype and device (``q.new_ones(())``): that tensor's values are not read.
_LIKE = {"new_ones", "new_zeros", "new_full", "new_empty"}
# The row dim an input is read with when any will do (the tensor of a ``_LIKE`` op).
ANY = "any"


def _tensor_index(index: Any) -> bool:
    """Whether ``index`` (a getitem's) is a tuple of index tensors only (advanced indexing)."""
    return isinstance(index, tuple) and bool(index) and all(isinstance(i, fx.Node) for i in index)


def _name(node: fx.Node) -> str:
    """The op's name, a Tensor method's or dunder's (``__eq__``, ``__rsub__``) as its operator function's."""
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        core = core[1:] if core in ("radd", "rsub", "rmul", "rand", "ror", "rxor") else core
        name = core + "_" if core in ("and", "or") else core
    return name


def _shape(value: Any) -> Optional[tuple[int, ...]]:
    value = value.meta.get("example_value", value.meta.get("val")) if isinstance(value, fx.Node) else value
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _index_map(index: Any, in_ndim: int) -> Optional[list[Optional[int]]]:
    """For ``x[index]``: the input dim each output dim comes from (None for a dim ``None`` adds), or None when
    ``index`` holds anything but ``None``, slices and one ``...``."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(item is Ellipsis for item in items) > 1:
        return None
    if any(not (item is None or item is Ellipsis or isinstance(item, slice)) for item in items):
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        consumed = sum(isinstance(item, slice) for item in items)
        items[at:at + 1] = [slice(None)] * (in_ndim - consumed)
    out: list[Optional[int]] = []
    source = 0
    for item in items:
        if item is None:
            out.append(None)
        else:
            out.append(source)
            source += 1
    out.extend(range(source, in_ndim))
    return out


def _full_slice(index: Any, dim: int) -> bool:
    """Whether ``index`` takes all of input dim ``dim`` (a ``slice(None)``, or no entry for it)."""
    items = list(index) if isinstance(index, tuple) else [index]
    source = 0
    for item in items:
        if item is None:
            continue
        if item is Ellipsis:
            return True  # an Ellipsis with only None/slice entries: _index_map expanded it; dims under it are whole
        if source == dim:
            return item == slice(None)
        source += 1
    return True


class RowBlocks:
    """The producers of ``mask`` (graph order, a closed computation) set up for evaluation by row blocks."""

    def __init__(self, producers: Sequence[fx.Node], mask: fx.Node, row_dim: dict[fx.Node, Optional[int]],
                 wanted: dict[tuple[fx.Node, fx.Node], Optional[int]], rows: int) -> None:
        self.producers, self.mask, self.row_dim, self.wanted, self.rows = list(producers), mask, row_dim, wanted, rows

    @classmethod
    def build(cls, producers: Sequence[fx.Node], mask: fx.Node) -> tuple[Optional["RowBlocks"], Optional[str]]:
        """(the plan, None), or (None, why the mask cannot be evaluated row by row)."""
        shape = _shape(mask)
        if shape is None or len(shape) < 2:
            return None, "its value is not a tensor of at least two dims"
        inside = set(producers)
        row_dim: dict[fx.Node, Optional[int]] = {mask: len(shape) - 2 if shape[-2] != 1 else None}
        wanted: dict[tuple[fx.Node, fx.Node], Optional[int]] = {}
        for node in reversed(list(producers)):
            if node not in row_dim:  # a producer nobody in the walk reads (cannot happen for a closed walk)
                row_dim[node] = None
            dim = row_dim[node]
            for source, source_dim in cls._sources(node, dim):
                if source not in inside:
                    continue
                if source_dim == ANY:
                    wanted[(node, source)] = ANY
                    continue
                if isinstance(source_dim, str):
                    return None, source_dim
                wanted[(node, source)] = source_dim
                if source_dim is not None:
                    known = row_dim.get(source)
                    if known is not None and known != source_dim:
                        return None, f"{source.name} would be read with two different row dims"
                    row_dim[source] = source_dim
                else:
                    row_dim.setdefault(source, None)
        for node, dim in row_dim.items():
            read_whole = any(wanted.get((user, node), 0) is None for user in node.users if user in inside)
            reads_rows = any(wanted.get((node, source)) not in (None, ANY) for source in node.all_input_nodes)
            if dim is not None and read_whole and reads_rows:
                return None, f"{node.name} is read both whole and by rows"
        kv = shape[-1]
        batch = 1
        for size in shape[:-2]:
            batch *= size
        rows = max(1, min(shape[-2], ROW_BLOCK_ELEMENTS // max(1, kv * batch)))
        return cls(producers, mask, row_dim, wanted, rows), None

    @staticmethod
    def _sources(node: fx.Node, dim: Optional[int]) -> list[tuple[fx.Node, Any]]:
        """(input node, the row dim it must have for ``node`` to have row dim ``dim``) per input node; a str
        in place of the dim says why ``node`` is not row-local."""
        inputs = node.all_input_nodes
        if node.op == "placeholder":
            return []  # a value given to ``blocks`` (the ids a packed mask is built from)
        name = _name(node)
        if name in _LIKE:  # the tensor gives only dtype and device: read as it comes (a block or whole)
            if dim is not None:
                return [(i, f"{node.name} ({name}) makes a value with the mask's rows") for i in inputs]
            return [(i, ANY) for i in inputs]
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.numel() <= ROW_BLOCK_ELEMENTS // SMALL_SHARE:
            # small enough to make whole and narrow, whatever the op (``cumsum`` of position ids, an arange)
            return [(i, None) for i in inputs]
        if dim is None:
            return [(i, None) for i in inputs]
        out_ndim = len(_shape(node) or ())

        def broadcast(source: fx.Node) -> Optional[int]:
            in_shape = _shape(source)
            if in_shape is None:
                return None
            offset = out_ndim - len(in_shape)
            d = dim - offset
            return None if d < 0 or in_shape[d] == 1 else d

        if name in _ELEMENTWISE or name in ("expand", "expand_as"):
            first = node.args[0] if node.args else None
            if name in ("expand", "expand_as"):
                return [(i, broadcast(i) if i is first else None) for i in inputs]
            return [(i, broadcast(i)) for i in inputs]
        if name in _UNARY:
            first = node.args[0] if node.args else None
            return [(i, dim if i is first else None) for i in inputs]
        if name == "unsqueeze":
            at = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if not isinstance(at, int):
                return [(i, f"{node.name} unsqueezes a dim that is not a constant") for i in inputs]
            at = at % out_ndim
            return [(node.args[0], None if dim == at else (dim if dim < at else dim - 1))]
        if name == "getitem" and node.target is operator.getitem and _tensor_index(node.args[1]):
            # x[i0, i1, ...] with index tensors over x's leading dims (transformers gathers the packed-sequence
            # ids by [batch index, query index]): row i of the result reads row i of the indices; x is whole.
            source, index = node.args
            in_shape = _shape(source)
            if in_shape is None or len(index) != len(in_shape):
                return [(source, f"{node.name} gathers with index tensors over only some of its input's dims")]
            return [(i, None if i is source else broadcast(i)) for i in inputs]
        if name == "getitem" and node.target is operator.getitem:
            source, index = node.args
            in_shape = _shape(source)
            mapping = _index_map(index, len(in_shape)) if in_shape is not None else None
            if mapping is None:
                return [(source, f"{node.name} indexes with more than None and slices")]
            d = mapping[dim]
            if d is None or in_shape[d] == 1:
                return [(source, None)]
            if not _full_slice(index, d):
                return [(source, f"{node.name} slices the mask's row dim")]
            return [(source, d)]
        if name in _TRIANGLE:
            if dim != out_ndim - 2:
                return [(i, f"{node.name}'s triangle is not over the mask's row and key dims") for i in inputs]
            return [(i, dim if i is node.args[0] else None) for i in inputs]
        if name in _CREATION or name == "arange":
            return [(i, None) for i in inputs]  # sizes and fill values: scalars
        return [(i, f"{node.name} ({name}) is not an op whose row i depends only on its inputs' row i")
                for i in inputs] or [(node, f"{node.name} ({name}) makes a value sloth cannot make by rows")]

    def blocks(self, given: Optional[dict[fx.Node, torch.Tensor]] = None) -> Iterator[tuple[int, torch.Tensor]]:
        """(r0, the mask's rows [r0, r0 + rows)) for every block, outside any fake mode, under no_grad; ``given``
        holds the values of the producers that are graph inputs (a packed mask's ids)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        total = _shape(self.mask)[-2]
        whole: dict[fx.Node, Any] = dict(given or {})
        with unset_fake_temporarily(), torch.no_grad():
            for r0 in range(0, total, self.rows):
                r1 = min(total, r0 + self.rows)
                block: dict[fx.Node, Any] = {}
                for node in self.producers:
                    self._evaluate(node, r0, r1, whole, block)
                value = block[self.mask] if self.row_dim[self.mask] is not None else whole[self.mask]
                yield r0, value
                if self.row_dim[self.mask] is None:
                    return  # the mask is broadcast along rows: one evaluation is all of it

    def _evaluate(self, node: fx.Node, r0: int, r1: int, whole: dict[fx.Node, Any], block: dict[fx.Node, Any]) -> None:
        dim = self.row_dim[node]
        if dim is None:
            if node not in whole:
                whole[node] = self._call(node, lambda source: self._read_any(source, whole, block)
                                         if self.wanted.get((node, source)) == ANY else whole[source])
            return
        name = _name(node)
        if node in whole and node.op == "placeholder":  # a given input with a row dim: narrowed to the block
            block[node] = whole[node].narrow(dim, r0, r1 - r0)
            return
        reads_block = any(self.wanted.get((node, i)) not in (None, ANY) for i in node.all_input_nodes)
        if not reads_block:
            if name in _CREATION:
                block[node] = self._call(node, lambda source: whole[source], resize=(dim, r1 - r0))
            else:  # the query index (an arange) or a value computed from row-free inputs: whole, then narrowed
                if node not in whole:
                    whole[node] = self._call(node, lambda source: whole[source])
                block[node] = whole[node].narrow(dim, r0, r1 - r0)
            return

        def read(source: fx.Node) -> Any:
            how = self.wanted.get((node, source))
            if how == ANY:
                return self._read_any(source, whole, block)
            return block[source] if how is not None else whole[source]

        if name in ("expand",):
            block[node] = self._call(node, read, resize=(dim, r1 - r0))
        elif name in _TRIANGLE:
            block[node] = self._call(node, read, diagonal_shift=r0)
        else:
            block[node] = self._call(node, read)

    @staticmethod
    def _read_any(source: fx.Node, whole: dict[fx.Node, Any], block: dict[fx.Node, Any]) -> Any:
        return block[source] if source in block else whole[source]

    @staticmethod
    def _call(node: fx.Node, read: Any, resize: Optional[tuple[int, int]] = None, diagonal_shift: int = 0) -> Any:
        args = fx.node.map_arg(node.args, read)
        kwargs = dict(fx.node.map_arg(node.kwargs, read))
        if resize is not None:
            args, kwargs = _resized(node, args, kwargs, *resize)
        if diagonal_shift:
            diagonal = args[1] if len(args) > 1 else kwargs.pop("diagonal", 0)
            args = (args[0], diagonal + diagonal_shift) + tuple(args[2:])
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


def _resized(node: fx.Node, args: tuple, kwargs: dict, dim: int, length: int) -> tuple[tuple, dict]:
    """``node``'s arguments with the size of ``dim`` set to ``length`` (creation ops and ``expand``)."""
    name = _name(node)
    if name == "expand":
        sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else list(args[1:])
        sizes[dim] = length
        return (args[0], *sizes), kwargs
    if "size" in kwargs:
        sizes = list(kwargs["size"])
        sizes[dim] = length
        return args, {**kwargs, "size": tuple(sizes)}
    if args and isinstance(args[0], (tuple, list, torch.Size)):
        sizes = list(args[0])
        sizes[dim] = length
        return (tuple(sizes), *args[1:]), kwargs
    count = len(_shape(node))  # ones(L, S): the sizes are the leading positional args (full's fill follows them)
    sizes = list(args[:count])
    sizes[dim] = length
    return (*sizes, *args[count:]), kwargs
