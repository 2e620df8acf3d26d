// The Python bindings of the row-invariant kernels (see rowwise.h).

#include "rowwise.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_isa", &linear_isa, "the instructions a bf16 x bf16 linear_packed uses in this process");
  m.def("pack_linear", &pack_linear, "pack a bf16 / fp32 weight (N, K) for linear_packed");
  m.def("linear_packed", &linear_packed, "row-invariant small-M linear over a packed weight");
  m.def("linear_rows", &linear_rows, "row-invariant small-M linear (bf16 / fp32 weights), packing on the call");
  m.def("paged_attention_rows", &paged_attention_rows, "row-invariant paged attention, one key set per row");
  m.def("rms_norm_rows", &rms_norm_rows, "row-invariant RMSNorm of every row (bf16 / fp32)");
}
