// Backward bodies issued from C++ (NOTE [Backward bodies from C++] in slimgrad/_ext/__init__.py):
// the ATen ops a slimgrad backward's Python body calls, the same ops on the same operands in the
// same order, each through the C++ function that its Python binding calls, so the results are the
// same bits, the same buffers and the same dispatches (a dispatch mode, the profiler and the
// autograd engine see the same ops). Each function returns None where its case does not hold (a
// tensor subclass, a torch function mode, a layout or dtype the Python body treats otherwise); the
// caller then runs its Python body.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ScalarOps.h>

#include <cstdint>
#include <vector>

long slimgrad_watcher_mask();  // storage_facts.cpp: NOTE [One-call gate]'s five watchers

namespace {

// The GIL released while the ops run, as torch's own Python bindings release it around each op.
struct NoGil {
  PyThreadState* state;
  NoGil() : state(PyEval_SaveThread()) {}
  ~NoGil() { PyEval_RestoreThread(state); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
};

PyObject* parameter_type() {
  static PyObject* type = nullptr;  // torch.nn.Parameter, looked up once
  if (type == nullptr) {
    PyObject* mod = PyImport_ImportModule("torch.nn.parameter");
    if (mod == nullptr) {
      return nullptr;
    }
    type = PyObject_GetAttrString(mod, "Parameter");
    Py_DECREF(mod);
  }
  return type;
}

// A tensor whose Python methods run nothing but the ATen op: exactly torch.Tensor (or, where
// ``param`` is set, torch.nn.Parameter, whose __torch_function__ is disabled), without the keys of
// a functorch wrapper, a functional tensor or a Python subclass. -1: a Python error is set.
int plain(PyObject* obj, bool param) {
  if (!THPVariable_CheckExact(obj)) {
    if (!param || !THPVariable_Check(obj)) {
      return 0;
    }
    PyObject* type = parameter_type();
    if (type == nullptr) {
      return -1;
    }
    if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != type) {
      return 0;
    }
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined()) {
    return 0;
  }
  const c10::DispatchKeySet ks = t.key_set();
  if (ks.has(c10::DispatchKey::FuncTorchGradWrapper) ||
      ks.has(c10::DispatchKey::FuncTorchBatched) || ks.has(c10::DispatchKey::Functionalize) ||
      ks.has(c10::DispatchKey::Python)) {
    return 0;
  }
  return 1;
}

// A Python int argument of a Tensor parameter, as torch's Python argument parser passes it: a
// wrapped-number 0-dim tensor (what ``t.div_(d)`` hands ATen's ``div_.Tensor``).
at::Tensor wrapped(int64_t v) {
  at::Tensor s = at::scalar_to_tensor(at::Scalar(v));
  s.unsafeGetTensorImpl()->set_wrapped_number(true);
  return s;
}

}  // namespace

// rms_norm_bwd's case checks and body on tensors, for rms_norm_bwd below and the C++ RMSNorm
// node (norm_node.cpp): false, and nothing run, where the case does not hold. Runs without the
// GIL (the caller released it, or holds none: an autograd node).
bool slimgrad_rms_norm_bwd_core(
    const at::Tensor& dy,
    const at::Tensor& y,
    const at::Tensor& rstd,
    const at::Tensor& weight,
    int64_t d,
    bool need_dw,
    bool inplace,
    int64_t chunk,
    at::Tensor& g,
    at::Tensor& dw) {
  const at::ScalarType acc = y.scalar_type();
  if ((acc != at::kFloat && acc != at::kDouble) || dy.scalar_type() != acc ||
      rstd.scalar_type() != acc || rstd.dim() != y.dim() || !dy.sizes().equals(y.sizes()) ||
      !dy.is_contiguous() || d <= 0) {
    return false;
  }
  const int64_t numel = y.numel();
  if (numel == 0 || numel % d != 0) {
    return false;
  }
  const int64_t n = numel / d;
  int64_t step = numel / 16;  // rms_norm_bwd_torch's row step
  if (step < chunk) {
    step = chunk;
  }
  step /= d > 1 ? d : 1;
  if (step < 1) {
    step = 1;
  }
  if (step < n) {
    return false;
  }
  {
    at::Tensor wt = weight;
    if (wt.scalar_type() != acc) {
      wt = wt.to(acc);
    }
    at::Tensor xh = at::div(y, wt);
    if (need_dw) {
      // one statement per call, each temporary dropped after its last use as Python drops it
      // (a C++ temporary would live to the end of its full expression: a higher peak)
      at::Tensor t = at::mul(dy, xh).reshape({n, d});
      at::Tensor s = t.sum({0}, false, at::kDouble);
      t.reset();
      dw = s.to(weight.scalar_type());
      s.reset();
      if (weight.dim() != 1) {
        dw = dw.reshape(weight.sizes());
      }
    }
    g = inplace ? dy.mul_(wt) : at::mul(dy, wt);
    at::Tensor c2 =
        at::bmm(g.reshape({n, 1, d}), xh.reshape({n, d, 1})).view(rstd.sizes()).div_(wrapped(d));
    g.sub_(xh.mul_(c2)).mul_(rstd);
  }
  return true;
}

namespace {

// rms_norm_bwd(dy, y, rstd, weight, d, need_dw, inplace, chunk_elems, gate) (d: the row length, or
// the normalized shape as a list or tuple of ints): the one-chunk
// backward of slimgrad._math.norms.rms_norm_bwd_torch (NOTE [RMSNorm's one-chunk backward in the
// tensors' own shapes] there) with dx needed, a weight, no fallback channel and no input kept:
//     wt = weight (cast to y's dtype if it is not in it); xh = torch.div(y, wt)
//     dw = (dy * xh).reshape(n, d).sum(0, dtype=torch.float64).to(weight.dtype) [.reshape(w)]
//     g = dy.mul_(wt) if inplace else dy * wt
//     c2 = torch.bmm(g.reshape(n, 1, d), xh.reshape(n, d, 1)).view(rstd.shape).div_(d)
//     g.sub_(xh.mul_(c2)).mul_(rstd)
// Returns (g, dw or None), or None where that path's conditions do not hold: y, dy, rstd float32
// or float64 alike, dy of y's shape and contiguous, rstd of y's rank, d > 0 dividing y's elements,
// one chunk (rows <= max(chunk_elems, numel // 16) // d), plain tensors, no torch function mode,
// and with ``gate`` no watcher at all (NOTE [One-call gate] in slimgrad/_library.py).
PyObject* rms_norm_bwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *pdy = nullptr, *py = nullptr, *prstd = nullptr, *pw = nullptr, *pd = nullptr;
  long long chunk = 0;
  int need_dw = 0, inplace = 0, gate = 0;
  if (!PyArg_ParseTuple(
          args, "OOOOOppLp", &pdy, &py, &prstd, &pw, &pd, &need_dw, &inplace, &chunk, &gate)) {
    return nullptr;
  }
  // d: an int, or the normalized shape (a list or tuple of ints) whose product it is
  long long d = 1;
  if (PyLong_Check(pd)) {
    d = PyLong_AsLongLong(pd);
  } else if (PyList_Check(pd) || PyTuple_Check(pd)) {
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(pd);
    for (Py_ssize_t i = 0; i < k; ++i) {
      PyObject* item = PySequence_Fast_GET_ITEM(pd, i);
      if (!PyLong_Check(item)) {
        Py_RETURN_NONE;
      }
      d *= PyLong_AsLongLong(item);
    }
  } else {
    Py_RETURN_NONE;
  }
  if (PyErr_Occurred()) {
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled() || (gate && slimgrad_watcher_mask() != 0)) {
    Py_RETURN_NONE;
  }
  for (PyObject* o : {pdy, py, prstd, pw}) {
    const int ok = plain(o, o == pw);
    if (ok <= 0) {
      if (ok < 0) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
  }
  const at::Tensor& dy = THPVariable_Unpack(pdy);
  const at::Tensor& y = THPVariable_Unpack(py);
  const at::Tensor& rstd = THPVariable_Unpack(prstd);
  const at::Tensor& weight = THPVariable_Unpack(pw);
  at::Tensor g, dw;
  bool ran = false;
  {
    NoGil nogil;
    ran = slimgrad_rms_norm_bwd_core(dy, y, rstd, weight, d, need_dw, inplace, chunk, g, dw);
  }
  if (!ran) {
    Py_RETURN_NONE;
  }
  PyObject* out_g = THPVariable_Wrap(std::move(g));
  if (out_g == nullptr) {
    return nullptr;
  }
  if (!need_dw) {
    return Py_BuildValue("(NO)", out_g, Py_None);
  }
  PyObject* out_dw = THPVariable_Wrap(std::move(dw));
  if (out_dw == nullptr) {
    Py_DECREF(out_g);
    return nullptr;
  }
  return Py_BuildValue("(NN)", out_g, out_dw);
  END_HANDLE_TH_ERRORS
}

// gated_mlp_bwd(dy, x, g, u, wg, wu, wd, act): the straight backward of slimgrad.ops.gated_mlp
// (NOTE [The gated MLP's straight backward] there), act 0 SiLU, 1 erf GELU, 2 tanh GELU:
//     dy2, g2, u2 = dy.reshape(-1, D), g.reshape(-1, I), u.reshape(-1, I)
//     a = act(g2); dwd = dy2.t() @ (a * u2); dh = dy2 @ wd
//     du = a.mul_(dh); da = dh.mul_(u2); dg = act_backward(da, g2, grad_input=da)
//     dx = dg.new_empty((*dy.shape[:-1], xd)); dx2 = dx.view(-1, xd); torch.mm(dg, wg, out=dx2)
//     x2 = x.reshape(-1, xd); dwg = dg.t() @ x2; del dg, da, dh
//     dx2.add_(du @ wu); dwu = du.t() @ x2
// Returns (dx, dwg, dwu, dwd), or None for a tensor subclass or under a torch function mode (the
// caller decided the case: ctx.straight, no autocast, not compiling).
PyObject* gated_mlp_bwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *pdy = nullptr, *px = nullptr, *pg = nullptr, *pu = nullptr;
  PyObject *pwg = nullptr, *pwu = nullptr, *pwd = nullptr;
  int act = 0;
  if (!PyArg_ParseTuple(args, "OOOOOOOi", &pdy, &px, &pg, &pu, &pwg, &pwu, &pwd, &act)) {
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled() || act < 0 || act > 2) {
    Py_RETURN_NONE;
  }
  for (PyObject* o : {pdy, px, pg, pu, pwg, pwu, pwd}) {
    const int ok = plain(o, o == pwg || o == pwu || o == pwd);
    if (ok <= 0) {
      if (ok < 0) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
  }
  const at::Tensor& dy = THPVariable_Unpack(pdy);
  const at::Tensor& x = THPVariable_Unpack(px);
  const at::Tensor& g = THPVariable_Unpack(pg);
  const at::Tensor& u = THPVariable_Unpack(pu);
  const at::Tensor& wg = THPVariable_Unpack(pwg);
  const at::Tensor& wu = THPVariable_Unpack(pwu);
  const at::Tensor& wd = THPVariable_Unpack(pwd);
  if (dy.dim() < 1 || g.dim() < 1 || x.dim() < 1) {
    Py_RETURN_NONE;
  }
  at::Tensor dx, dwg, dwu, dwd;
  {
    NoGil nogil;
    const int64_t d = dy.size(-1), n = g.size(-1);
    at::Tensor dy2 = dy.reshape({-1, d});
    at::Tensor g2 = g.reshape({-1, n});
    at::Tensor u2 = u.reshape({-1, n});
    const c10::string_view approx = act == 2 ? "tanh" : "none";
    at::Tensor a = act == 0 ? at::silu(g2) : at::gelu(g2, approx);
    dwd = at::matmul(dy2.t(), at::mul(a, u2));
    at::Tensor dh = at::matmul(dy2, wd);
    at::Tensor du = a.mul_(dh);
    a.reset();
    at::Tensor da = dh.mul_(u2);
    at::Tensor dg = act == 0 ? at::silu_backward_out(da, da, g2)
                             : at::gelu_backward_out(da, da, g2, approx);
    const int64_t xd = x.size(-1);
    std::vector<int64_t> shape(dy.sizes().begin(), dy.sizes().end() - 1);
    shape.push_back(xd);
    dx = dg.new_empty(shape);
    at::Tensor dx2 = dx.view({-1, xd});
    at::mm_out(dx2, dg, wg);
    at::Tensor x2 = x.reshape({-1, xd});
    dwg = at::matmul(dg.t(), x2);
    dg.reset();  // one buffer: freed before du's matmuls
    da.reset();
    dh.reset();
    dx2.add_(at::matmul(du, wu));
    dwu = at::matmul(du.t(), x2);
  }
  return Py_BuildValue(
      "(NNNN)",
      THPVariable_Wrap(std::move(dx)),
      THPVariable_Wrap(std::move(dwg)),
      THPVariable_Wrap(std::move(dwu)),
      THPVariable_Wrap(std::move(dwd)));
  END_HANDLE_TH_ERRORS
}

}  // namespace

// Added to the extension's module by storage_facts.cpp's init.
PyMethodDef slimgrad_backward_methods[] = {
    {"rms_norm_bwd", rms_norm_bwd, METH_VARARGS,
     "RMSNorm's one-chunk backward (slimgrad._math.norms.rms_norm_bwd_torch), else None."},
    {"gated_mlp_bwd", gated_mlp_bwd, METH_VARARGS,
     "The gated MLP's straight backward (slimgrad.ops.gated_mlp), else None."},
    {nullptr, nullptr, 0, nullptr}};
