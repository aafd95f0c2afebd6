// The titan native ops: schemas (one place for CPU, CUDA and Meta) and the Python module
// titan_kernels._C, whose import registers everything. Implementations: cpu/*.cpp (CPU),
// cuda/binding.cpp (CUDA), meta.cpp (shapes only, for FakeTensor / torch.compile).
//
// The Python op layer (titan_kernels/ops/*.py) calls these as the "cpu" / "cuda" backends; their
// contracts equal titan_kernels/reference/*.py. An optional output that is not computed is an
// undefined tensor (None in Python), as in aten::native_layer_norm_backward.
#include <Python.h>

#include <torch/library.h>

#include "autograd_node.h"
#include "cpu/kernels.h"

TORCH_LIBRARY_FRAGMENT(titan, m) {
  m.def("rms_norm_fwd_native(Tensor x, Tensor? residual, Tensor? weight, float eps) -> (Tensor y, Tensor h, Tensor rstd)");
  m.def("rms_norm_bwd_native(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, Tensor? dresidual, bool compute_dweight)"
        " -> (Tensor dx, Tensor dweight)");
  m.def("rotary_fwd_native(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved)"
        " -> (Tensor q_out, Tensor k_out)");
  m.def("rotary_bwd_native(Tensor dq, Tensor dk, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved)"
        " -> (Tensor dq_in, Tensor dk_in)");
  m.def("swiglu_fwd_native(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd_native(Tensor dy, Tensor gate, Tensor up) -> (Tensor dgate, Tensor dup)");
  // GPT-OSS's clamped SwiGLU: the same kernels with alpha, limit (None: no clamp), up_offset. Separate ops
  // rather than defaults on the two above: a schema with defaults costs every plain call ~0.2 us to parse.
  m.def("swiglu_clamped_fwd_native(Tensor gate, Tensor up, float alpha, float? limit, float up_offset) -> Tensor");
  m.def("swiglu_clamped_bwd_native(Tensor dy, Tensor gate, Tensor up, float alpha, float? limit, float up_offset)"
        " -> (Tensor dgate, Tensor dup)");
  m.def("fused_adamw_native_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,"
        " float beta1, float beta2, float eps, float decay, float step_size, float bc2_sqrt, int[] keys,"
        " int[] offsets) -> ()");
}

namespace {

PyObject* has_cpu(PyObject*, PyObject*) { Py_RETURN_TRUE; }

PyObject* has_cuda(PyObject*, PyObject*) {
#ifdef TITAN_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyObject* cpu_capability(PyObject*, PyObject*) { return PyUnicode_FromString(titan::cpu::capability()); }

PyObject* set_cpu_capability(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : nullptr;
  if (name == nullptr) {
    PyErr_Format(PyExc_TypeError, "capability: expected a str, got %s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  try {
    titan::cpu::set_capability(name);
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"has_cpu", has_cpu, METH_NOARGS, "True: the C++ CPU kernels are built."},
    {"has_cuda", has_cuda, METH_NOARGS, "True when the CUDA kernels are built into this extension."},
    {"cpu_capability", cpu_capability, METH_NOARGS,
     "The instruction set of the CPU kernels in use: 'default', 'avx2' or 'avx512'."},
    {"set_cpu_capability", set_cpu_capability, METH_O,
     "Use the CPU kernels built for 'default', 'avx2' or 'avx512' (or 'auto'); ValueError if this CPU "
     "or build lacks it. For tests and benchmarks."},
    {"autograd_apply", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(titan::autograd_apply)),
     METH_FASTCALL,
     "autograd_apply(spec, plan, args, *inputs): an eager planned call's autograd node with a Python "
     "backward (csrc/autograd_node.h)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "Native titan kernels (registers torch.ops.titan.*_native).", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kModule); }
