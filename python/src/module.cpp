// fusekit._C: every op as a function of arrays, outputs passed in (the caller allocates them, so
// PyTorch's allocator sees every byte), run on the caller's stream. The Python layer (the package
// fusekit/ops/) makes each one a torch.library custom op with its fake and autograd rules. This file
// defines the module and its core (errors, build information, the memory source); each family's ops
// are bound in python/src/<family>.cpp, DLPack arrays become TensorViews in convert.cpp.
//
// Conventions: arguments in the C++ op's order, outputs last before the options; optional tensors
// are None; `stream` is a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream),
// ignored for host tensors. The GIL is released while an op runs. fk::Error becomes
// fusekit.Error (a ValueError) with fusekit's message.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/fusekit.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace fk::py {
namespace {

void bind_core(nb::module_& m) {
  m.def("build_info", [] {
    const BuildInfo b = build_info();
    nb::dict d;
    d["version"] = b.version;
    d["commit"] = b.commit;
    d["cuda"] = b.cuda;
    d["cuda_targets"] = b.cuda_targets;
    d["cuda_compiler"] = b.cuda_compiler;
    d["build_type"] = b.build_type;
    return d;
  });
  m.def("cuda_device_count", [] { return cuda_device_count(); });
}

// The device memory of every op (scratch buffers too) from Python callables: allocate(bytes,
// stream) -> address and free(address), PyTorch's caching allocator in fusekit/__init__.py.
struct PyMemorySource {
  nb::object allocate, free;
};

void* py_allocate(void* context, std::size_t bytes, int /*device*/, void* stream) {
  const auto* source = static_cast<const PyMemorySource*>(context);
  std::string failure;
  {
    nb::gil_scoped_acquire gil;
    try {
      return reinterpret_cast<void*>(
          nb::cast<std::uintptr_t>(source->allocate(bytes, reinterpret_cast<std::uintptr_t>(stream))));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  throw Error("allocate", "cannot allocate " + std::to_string(bytes) + " bytes of device memory: " + failure);
}

void py_deallocate(void* context, void* ptr, int /*device*/, void* /*stream*/) noexcept {
  if (!nb::is_alive()) return;  // the interpreter is gone: the process is ending
  nb::gil_scoped_acquire gil;
  try {
    static_cast<const PyMemorySource*>(context)->free(reinterpret_cast<std::uintptr_t>(ptr));
  } catch (const std::exception&) {
    // free(address) raised: nothing to hand the error to from a destructor; the block is lost.
  }
}

void bind_memory(nb::module_& m) {
  m.def(
      "set_memory_source",
      [](nb::object allocate, nb::object free) {
        if (allocate.is_none() != free.is_none())
          throw Error("set_memory_source", "free", "None exactly when allocate is None", "the other");
        if (allocate.is_none()) return allocator::set_device_memory_source(nullptr);
        // Never freed: blocks may go back to it while the interpreter shuts down.
        auto* held = new PyMemorySource{std::move(allocate), std::move(free)};
        DeviceMemorySource source;
        source.allocate = py_allocate;
        source.deallocate = py_deallocate;
        source.context = held;
        allocator::set_device_memory_source(&source);
      },
      "allocate"_a.none(), "free"_a.none());
  m.def("allocator_stats", [](int device) {
    const AllocatorStats st = allocator::stats(Device::cuda(device));
    nb::dict d;
    d["allocated_bytes"] = st.allocated_bytes;
    d["cached_bytes"] = st.cached_bytes;
    d["device_allocations"] = st.device_allocations;
    return d;
  }, "device"_a);
}

}  // namespace
}  // namespace fk::py

NB_MODULE(_C, m) {
  m.doc() = "fusekit's ops on DLPack arrays (see fusekit.ops for the PyTorch operators)";
  static nb::exception<fk::Error> error(m, "Error", PyExc_ValueError);
  fk::py::bind_core(m);
  fk::py::bind_memory(m);
  fk::py::bind_pointwise(m);
  fk::py::bind_primitives(m);
  fk::py::bind_quant(m);
  fk::py::bind_glu(m);
  fk::py::bind_lora(m);
  fk::py::bind_qgemm(m);
  fk::py::bind_mlp(m);
  fk::py::bind_recsys(m);
  fk::py::bind_loss(m);
  fk::py::bind_norm(m);
}
