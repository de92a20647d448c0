// Python bindings of the KV-store launchers. The GIL is released around every launch.
#include <pybind11/pybind11.h>

#include "kv_store.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "nano_kvcache CUDA kernels (raw pointers and stream handles, no libtorch)";
  m.attr("__version__") = NANO_KVCACHE_VERSION;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("store_kvcache", &nano_kvcache::store_kvcache, nogil, py::arg("key"), py::arg("value"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("slot_bytes"),
        py::arg("num_tokens"), py::arg("num_slots"), py::arg("num_heads"), py::arg("row_bytes"),
        py::arg("key_stride_token"), py::arg("key_stride_head"), py::arg("value_stride_token"),
        py::arg("value_stride_head"), py::arg("block_size"), py::arg("device"),
        py::arg("stream"));
  m.def("store_kvcache_fp8", &nano_kvcache::store_kvcache_fp8, nogil, py::arg("key"),
        py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("slot_bytes"), py::arg("num_tokens"), py::arg("num_slots"), py::arg("num_heads"),
        py::arg("head_dim"), py::arg("key_stride_token"), py::arg("key_stride_head"),
        py::arg("value_stride_token"), py::arg("value_stride_head"), py::arg("block_size"),
        py::arg("dtype"), py::arg("k_inv_scale"), py::arg("v_inv_scale"), py::arg("device"),
        py::arg("stream"));
  m.def("compute_slot_mapping", &nano_kvcache::compute_slot_mapping, nogil,
        py::arg("block_tables"), py::arg("table_stride"), py::arg("max_blocks"),
        py::arg("query_start_loc"), py::arg("start_pos"), py::arg("num_seqs"),
        py::arg("block_size"), py::arg("slot_mapping"), py::arg("positions"),
        py::arg("num_tokens"), py::arg("device"), py::arg("stream"));
  m.def("copy_blocks", &nano_kvcache::copy_blocks, nogil, py::arg("cache"), py::arg("num_planes"),
        py::arg("num_blocks"), py::arg("block_bytes"), py::arg("block_mapping"),
        py::arg("num_pairs"), py::arg("device"), py::arg("stream"));
}
