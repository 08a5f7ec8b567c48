"""CPU float32 weight layouts: the same products, stored the way this machine multiplies fastest.

PyTorch's default CPU linear repacks its weight on every call, which on some CPUs makes a pass over
2–5 positions (a verify round) cost nearly as much per row as one-row decoding, and on others is
the faster choice. A float32 model's linears become SwitchableLinear, which keeps each layout asked
for; the start-up measurements (tuning.py, autotune.py) pick one per pass size and drop the rest.
int4 and bfloat16 models keep their own products (one layout: plain).
"""

from __future__ import annotations

import torch

from specd_engine import autotune


class LayoutSwitch:
    """Which weight layout the next forward's linear layers use (set by CausalLM before each pass;
    passes are serialised by its lock, so one shared attribute is enough)."""

    def __init__(self, layout: str = autotune.PLAIN):
        self.layout = layout


def available_layouts() -> set[str]:
    """The CPU weight layouts this torch build can run (plain, tall, cols and rows always; prepacked
    with oneDNN; mkl with MKL's packed GEMM)."""
    layouts = {autotune.PLAIN, autotune.TALL, autotune.COLS, autotune.ROWS}
    if torch.backends.mkldnn.is_available():
        layouts.add(autotune.PREPACKED)
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        layouts.add(autotune.MKL)
    return layouts


class SwitchableLinear(torch.nn.Module):
    """y = x Wᵀ + b, with W kept in the layouts asked for; `switch.layout` picks per forward:
      plain      PyTorch's linear on the ordinary weight (repacks it on every call for several rows);
      prepacked  oneDNN's blocked layout, reordered once at load (what torch.utils.mkldnn.MkldnnLinear
                 does, without its deprecated TorchScript base);
      mkl        MKL's packed GEMM for one row (a decoding step), packed once at load; other row counts
                 run the plain path;
      tall       for a weight with more rows than columns (out > in: an LM head, an MLP's gate/up) and
                 several input rows, (W xᵀ)ᵀ: the BLAS call then streams the tall weight once for all
                 rows instead of repacking it; other layers, and one row, run the plain path. The
                 result is copied out contiguous: left a transposed view, every later step of a
                 ragged pass read it strided (16 sessions' decoding pass: 285 ms, 120 contiguous);
      cols       (W xᵀ)ᵀ for every weight and several rows (one row: plain);
      rows       x (Wᵀ), Wᵀ copied once at load into its own contiguous [in, out] tensor: for one row a
                 plain GEMV over contiguous output columns (2-core AMD EPYC VM: a decoding step of the
                 default target 45 ms vs 53 with mkl or plain).
    Input and output are ordinary dense tensors [..., in] → [..., out]. Same math; the layouts' float32
    results differ only by summation order (~1e-4 in the logits)."""

    def __init__(self, linear: torch.nn.Linear, switch: LayoutSwitch, keep: set[str]):
        super().__init__()
        self.out_features = linear.out_features
        self.switch = switch
        dense = bool(keep & autotune.DENSE_LAYOUTS)  # MKL's op falls back to (and takes) the plain weight
        self.tall = linear.out_features > linear.in_features
        self.weight = linear.weight if dense else None  # [out, in], shared (tied embeddings stay tied)
        self.bias = linear.bias if dense or autotune.ROWS in keep else None
        packed = autotune.PREPACKED in keep
        self.register_buffer("packed_weight", linear.weight.detach().to_mkldnn() if packed else None)
        self.register_buffer("packed_bias", linear.bias.detach().to_mkldnn() if packed and linear.bias is not None else None)
        mkl = autotune.MKL in keep
        self.register_buffer("mkl_weight", torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), 1) if mkl else None)
        transposed = linear.weight.detach().t().contiguous() if autotune.ROWS in keep else None  # [in, out]
        self.register_buffer("rows_weight", transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.switch.layout
        if layout == autotune.MKL and self.mkl_weight is not None and x.numel() == x.shape[-1]:  # one row
            y = torch.ops.mkl._mkl_linear(x.reshape(1, -1), self.mkl_weight, self.weight, self.bias, 1)  # [1, out]
            return y.reshape(*x.shape[:-1], self.out_features)
        if layout == autotune.ROWS and self.rows_weight is not None:
            y = torch.matmul(x, self.rows_weight)  # [..., out]
            return y if self.bias is None else y + self.bias
        streams_weight = layout == autotune.COLS or (layout == autotune.TALL and self.tall)  # W xᵀ: one pass over W
        if streams_weight and self.weight is not None and x.numel() > x.shape[-1]:
            rows = x.reshape(-1, x.shape[-1])  # [N, in]
            y = torch.mm(self.weight, rows.t()).t().contiguous()  # [N, out] (W xᵀ [out, N] transposed)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.packed_weight is not None and (layout == autotune.PREPACKED or self.weight is None):
            rows = x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn()  # [N, in]
            y = torch._C._nn.mkldnn_linear(rows, self.packed_weight, self.packed_bias).to_dense()  # [N, out]
            return y.reshape(*x.shape[:-1], self.out_features)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def make_linears_switchable(model: torch.nn.Module, switch: LayoutSwitch, keep: set[str]) -> int:
    """Replace every float32 nn.Linear by a SwitchableLinear keeping the `keep` layouts.

    Why: PyTorch's default CPU linear repacks the weight on every call, which on some CPUs makes a
    pass over 2–5 positions (a verify round) cost nearly as much per row as one-row decoding, and on
    others is the faster choice (specd_engine/autotune.py measures which). CPU float32 only; returns
    how many layers were replaced (0 when only the plain layout is kept or available)."""
    keep = keep & available_layouts()
    if keep <= {autotune.PLAIN}:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32:
                setattr(parent, name, SwitchableLinear(child, switch, keep))
                replaced += 1
    return replaced


def drop_unused(module: torch.nn.Module, layouts: set[str]) -> None:
    """Drop the weights of layouts no pass will use from every SwitchableLinear in `module` (frees their memory)."""
    for linear in module.modules():
        if isinstance(linear, SwitchableLinear):
            if not layouts & autotune.DENSE_LAYOUTS:
                linear.weight = None
                if autotune.ROWS not in layouts:
                    linear.bias = None
            if autotune.PREPACKED not in layouts:
                linear.packed_weight = linear.packed_bias = None
            if autotune.MKL not in layouts:
                linear.mkl_weight = None
            if autotune.ROWS not in layouts:
                linear.rows_weight = None
