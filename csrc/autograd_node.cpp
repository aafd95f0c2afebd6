// titan_kernels._C.autograd_apply: an autograd node whose backward is a Python callable, the native
// carrier of an op's one autograd definition (its Python setup and grads, titan_kernels/ops/_scaffold.py)
// on the eager planned path. It does what torch.autograd.Function does for that path, without its
// Python ctx object and bookkeeping (about 4 us of a 15 us small attention call on a 2-core CPU,
// bench/bench_overhead.py):
// - the forward runs with grad mode off and below autograd's view and in-place tracking (as a custom
//   op's body runs), so the kernel's views of the inputs cost no autograd metadata;
// - the node's next edges are the inputs' gradient edges, and it becomes the grad_fn of the outputs;
// - what the forward saves is kept as SavedVariables: version checks, saved-tensor hooks (activation
//   offload, checkpointing) and "backward through the graph a second time" behave as for any node;
// - a Python exception in the backward reaches the caller of backward() as itself; every Python
//   object is owned (THPObjectPtr), so an error on any path (a pack hook raising, a saved tensor
//   modified in place) leaks nothing.
// Forward-mode AD is refused (the op defines no jvp), as autograd.Function refuses it; so is compiled
// autograd at the backward (the node's backward is Python it cannot trace).
#include "autograd_node.h"

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/object_ptr.h>

namespace titan {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::Variable;
using torch::autograd::variable_list;
// A node's owning pointer: std::shared_ptr<Node> in older torch, c10::intrusive_ptr<Node> in newer.
using NodePtr = decltype(torch::autograd::Edge::function);

bool is_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// The Python objects a node keeps, released with the GIL held (a node may die on an autograd thread).
struct PyRef {
  PyObject* obj = nullptr;
  PyRef() = default;
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  void hold(PyObject* o) {  // (once, with the GIL)
    Py_XINCREF(o);
    obj = o;
  }
  ~PyRef() {
    // (at interpreter exit the object is left to the process's end: taking the GIL then can hang)
    if (obj != nullptr && Py_IsInitialized() && !is_finalizing()) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(obj);
      PyGILState_Release(state);
    }
  }
};

struct PyBackwardNode final : Node {
  PyRef backward;  // backward(ctx, saved_tensors, *grad_outputs) -> a gradient (or None) per input, extras None
  PyRef ctx;       // the forward's context (its attributes for the backward); never written after the forward
  std::string op_name;
  std::vector<SavedVariable> saved;

  std::string name() const override { return op_name; }

  void release_variables() override {
    // (torch calls this at every node's destruction too; at interpreter exit the data is left to it)
    if (saved.empty() || !Py_IsInitialized() || is_finalizing()) return;
    pybind11::gil_scoped_acquire gil;  // (a saved-tensor hook is a Python object)
    for (auto& s : saved) {
      s.reset_data();  // unpack then raises torch's "backward through the graph a second time"
    }
  }

  // Compiled autograd traces a node through these; this one has a Python backward it cannot trace.
  // (The planned path records the autograd.Function carrier instead while compiled autograd is on
  // at the forward: titan_kernels/ops/_scaffold.py.)
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const override {
    TORCH_CHECK(false, op_name, ": compiled autograd cannot trace this node (recorded by an eager call while "
                "compiled autograd was off); enable compiled autograd around the forward too, or compile "
                "the forward (torch.compile)");
  }

  variable_list apply(variable_list&& grads) override {
    pybind11::gil_scoped_acquire gil;
    NodePtr self = getptr();
    // The saved tensors go to this call's backward as an argument (never onto the shared ctx: a
    // retained graph may be differentiated by several threads at once).
    THPObjectPtr saved_tuple(PyTuple_New(static_cast<Py_ssize_t>(saved.size())));
    if (!saved_tuple) throw python_error();
    for (size_t i = 0; i < saved.size(); ++i) {
      Variable t = saved[i].unpack(self);  // (may throw: saved_tuple is released)
      PyObject* item = t.defined() ? THPVariable_Wrap(t) : (Py_INCREF(Py_None), Py_None);
      if (item == nullptr) throw python_error();
      PyTuple_SET_ITEM(saved_tuple.get(), static_cast<Py_ssize_t>(i), item);
    }
    THPObjectPtr args(PyTuple_New(static_cast<Py_ssize_t>(grads.size()) + 2));
    if (!args) throw python_error();
    Py_INCREF(ctx.obj);
    PyTuple_SET_ITEM(args.get(), 0, ctx.obj);
    PyTuple_SET_ITEM(args.get(), 1, saved_tuple.release());
    for (size_t i = 0; i < grads.size(); ++i) {
      PyObject* g = grads[i].defined() ? THPVariable_Wrap(grads[i]) : (Py_INCREF(Py_None), Py_None);
      if (g == nullptr) throw python_error();
      PyTuple_SET_ITEM(args.get(), static_cast<Py_ssize_t>(i) + 2, g);
    }
    THPObjectPtr result(PyObject_Call(backward.obj, args.get(), nullptr));
    if (!result) throw python_error();
    TORCH_CHECK(PyTuple_Check(result.get()) || PyList_Check(result.get()), op_name,
                ": the backward must return a tuple of gradients, got ", Py_TYPE(result.get())->tp_name);
    THPObjectPtr seq(PySequence_Fast(result.get(), "the backward must return a tuple"));
    if (!seq) throw python_error();

    const size_t n_inputs = num_outputs();
    variable_list out(n_inputs);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* g = PySequence_Fast_GET_ITEM(seq.get(), i);
      if (g == Py_None) continue;
      const bool extra = static_cast<size_t>(i) >= n_inputs;
      TORCH_CHECK(!extra && THPVariable_Check(g), op_name, ": the backward returned ",
                  extra ? "a gradient for an input that was not given" : "something other than a tensor or None",
                  " at position ", i);
      out[static_cast<size_t>(i)] = THPVariable_Unpack(g);
    }
    return out;
  }
};

template <typename P>
struct NodeMaker;

template <typename T>
struct NodeMaker<std::shared_ptr<T>> {
  // torch's own deleter (found by argument-dependent lookup where this torch has it): a long chain
  // of nodes is freed iteratively, not by a recursion that can overflow the stack.
  static std::shared_ptr<T> make() {
    return std::shared_ptr<T>(new PyBackwardNode(), [](T* node) { deleteNode(node); });
  }
};

template <typename T>
struct NodeMaker<c10::intrusive_ptr<T>> {
  static c10::intrusive_ptr<T> make() { return c10::make_intrusive<PyBackwardNode>(); }
};

bool is_tensor(PyObject* o) { return THPVariable_Check(o); }

}  // namespace

PyObject* autograd_apply(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 3 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 3) {
    PyErr_SetString(PyExc_TypeError, "autograd_apply(spec, plan, args, *inputs): spec is (forward, backward, name)");
    return nullptr;
  }
  PyObject* spec = args[0];
  PyObject* name = PyTuple_GET_ITEM(spec, 2);
  const char* op_name = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : nullptr;
  if (op_name == nullptr) {
    PyErr_SetString(PyExc_TypeError, "autograd_apply: the op's name must be a str");
    return nullptr;
  }
  variable_list inputs;
  inputs.reserve(static_cast<size_t>(nargs - 3));
  for (Py_ssize_t i = 3; i < nargs; ++i) {
    if (args[i] == Py_None) {
      inputs.emplace_back();
    } else if (is_tensor(args[i])) {
      const at::Tensor& t = THPVariable_Unpack(args[i]);
      if (t._fw_grad(/*level=*/0).defined()) {
        PyErr_Format(PyExc_RuntimeError, "%s: forward-mode AD (a dual tensor input) is not supported", op_name);
        return nullptr;
      }
      inputs.push_back(t);
    } else {
      PyErr_Format(PyExc_TypeError, "%s: autograd_apply input %zd: expected a tensor or None, got %s", op_name,
                   i - 3, Py_TYPE(args[i])->tp_name);
      return nullptr;
    }
  }

  THPObjectPtr result;
  {
    at::AutoGradMode no_grad(false);
    at::AutoDispatchBelowADInplaceOrView below_views;
    result = THPObjectPtr(PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(spec, 0), args[1], args[2], nullptr));
  }
  if (!result) return nullptr;
  if (!PyTuple_Check(result.get()) || PyTuple_GET_SIZE(result.get()) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: the native forward must return (outputs, ctx)", op_name);
    return nullptr;
  }
  PyObject* seen = PyTuple_GET_ITEM(result.get(), 0);
  PyObject* ctx = PyTuple_GET_ITEM(result.get(), 1);
  std::vector<at::Tensor> outputs;
  if (is_tensor(seen)) {
    outputs.push_back(THPVariable_Unpack(seen));
  } else if (PyTuple_Check(seen)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seen); ++i) {
      PyObject* o = PyTuple_GET_ITEM(seen, i);
      if (!is_tensor(o)) {
        PyErr_Format(PyExc_TypeError, "%s: the native forward's outputs must be tensors", op_name);
        return nullptr;
      }
      outputs.push_back(THPVariable_Unpack(o));
    }
  } else {
    PyErr_Format(PyExc_TypeError, "%s: the native forward's outputs must be a tensor or a tuple of them", op_name);
    return nullptr;
  }
  THPObjectPtr to_save(PyObject_GetAttrString(ctx, "to_save"));
  if (!to_save) return nullptr;
  if (!PyTuple_Check(to_save.get())) {
    PyErr_Format(PyExc_TypeError, "%s: ctx.to_save must be a tuple", op_name);
    return nullptr;
  }
  // The context keeps no tensor of its own: a saved-tensor hook (offload) must be what holds them.
  if (PyObject_SetAttrString(ctx, "to_save", Py_None) != 0) return nullptr;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(to_save.get()); ++i) {
    PyObject* s = PyTuple_GET_ITEM(to_save.get(), i);
    if (s != Py_None && !is_tensor(s)) {
      PyErr_Format(PyExc_TypeError, "%s: save_for_backward takes tensors or None", op_name);
      return nullptr;
    }
  }

  auto made = NodeMaker<NodePtr>::make();
  auto* node = static_cast<PyBackwardNode*>(made.get());
  NodePtr fn = std::move(made);
  node->op_name = std::string(op_name) + "Backward";
  node->backward.hold(PyTuple_GET_ITEM(spec, 1));
  node->ctx.hold(ctx);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (const auto& o : outputs) {
    torch::autograd::set_history(o, fn);
  }
  // The saved tensors (a pack hook may raise: everything above is owned and released): an output is
  // saved as one (no reference cycle through its grad_fn).
  node->saved.reserve(static_cast<size_t>(PyTuple_GET_SIZE(to_save.get())));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(to_save.get()); ++i) {
    PyObject* s = PyTuple_GET_ITEM(to_save.get(), i);
    if (s == Py_None) {
      node->saved.emplace_back();
      continue;
    }
    const at::Tensor& t = THPVariable_Unpack(s);
    bool is_output = false;
    for (const auto& o : outputs) {
      is_output = is_output || o.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
    }
    node->saved.emplace_back(t, is_output);
  }
  Py_INCREF(seen);
  return seen;
  END_HANDLE_TH_ERRORS
}

}  // namespace titan
