// titan_kernels._C.autograd_apply (autograd_node.cpp): the native carrier of an op's Python autograd
// definition on the eager planned path.
#pragma once

#include <Python.h>

namespace titan {

// autograd_apply(spec, plan, args, *inputs) with spec = (forward, backward, name): runs
// forward(plan, args) -> (outputs, ctx) with grad mode off, makes a node whose backward is
// backward(ctx, saved_tensors, *grad_outputs) the grad_fn of the outputs (a tensor or a tuple of
// tensors), with ctx.to_save (a tuple of tensors or None, taken and cleared) kept as saved variables
// and given back, unpacked, to each backward call. ``inputs``: tensors (or None) whose gradient edges the
// node takes, in the order the backward returns their gradients. Returns the outputs.
PyObject* autograd_apply(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

}  // namespace titan
