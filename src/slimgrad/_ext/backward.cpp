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
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ScalarOps.h>

#include <cstdint>
#include <initializer_list>
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

// plain() over every argument, those from ``first_param`` on allowed to be a Parameter and, with
// ``none_ok``, to be None (an absent weight or bias, skipped): 1 all plain, 0 one is not (the
// caller returns None: its Python body runs), -1 a Python error (set).
int all_plain(std::initializer_list<PyObject*> objs, size_t first_param, bool none_ok) {
  size_t i = 0;
  for (PyObject* o : objs) {
    const bool param = i++ >= first_param;
    if (none_ok && param && o == Py_None) {
      continue;
    }
    const int ok = plain(o, param);
    if (ok <= 0) {
      return ok;
    }
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

// A Python tuple of the tensors (None for an undefined one), each moved out: the gradients a
// backward body returns. nullptr with a Python error set if wrapping fails.
PyObject* tensors_or_none(std::initializer_list<at::Tensor*> res) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(res.size()));
  if (out == nullptr) {
    return nullptr;
  }
  Py_ssize_t i = 0;
  for (at::Tensor* t : res) {
    PyObject* o = Py_None;
    if (t->defined()) {
      o = THPVariable_Wrap(std::move(*t));
      if (o == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
    } else {
      Py_INCREF(o);
    }
    PyTuple_SET_ITEM(out, i++, o);
  }
  return out;
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
      // NOTE [A weight gradient over one or two rows] (slimgrad/_math/norms.py)
      if (n == 1) {
        dw = weight.scalar_type() == acc ? t.view({d}) : t.view({d}).to(weight.scalar_type());
        t.reset();
      } else if (n == 2 && weight.scalar_type() == acc) {
        dw = t.sum({0});
        t.reset();
      } else {
        at::Tensor s = t.sum({0}, false, at::kDouble);
        t.reset();
        dw = s.to(weight.scalar_type());
        s.reset();
      }
      if (weight.dim() != 1) {
        dw = dw.reshape(weight.sizes());
      }
    }
    g = inplace ? dy.mul_(wt) : at::mul(dy, wt);
    at::Tensor c2;
    {
      // NOTE [Row dots without autocast] (slimgrad/_math/norms.py)
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      c2 = at::bmm(g.reshape({n, 1, d}), xh.reshape({n, d, 1}));
    }
    c2 = c2.view(rstd.sizes()).div_(wrapped(d));
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
  if (const int ok = all_plain({pdy, py, prstd, pw}, 3, false); ok <= 0) {
    if (ok < 0) {
      return nullptr;
    }
    Py_RETURN_NONE;
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

// kernels/cpu/layer_norm.c's layer_norm_bwd_f32, its address read once from the ctypes function
// slimgrad.ops.layer_norm binds (the same C function the Python body calls through ctypes)
using LayerNormBwdF32 = void (*)(const float*, const float*, const float*, const float*,
                                 const float*, float*, float*, float*, float*, double*, double*,
                                 int64_t, int64_t, int64_t, int, int, int, int);

const void* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr() : nullptr;
}

// layer_norm_bwd(dy, y, rstd, weight, bias, normalized_shape, need_dx, need_dw, need_db,
// layer_norm_bwd_f32, min_block_rows, max_blocks): slimgrad.ops.layer_norm._bwd_cpu where dx is
// written over a granted dy (``out is dy``) and there is no fallback channel (NOTE [LayerNorm's
// backward from C++] there), the Python body's steps in its order:
//     d = prod(normalized_shape); n = y.numel() // (d if d > 1 else 1)
//     rpb = max(min_block_rows, ceil(n / max_blocks)); nblk = ceil(n / rpb); parts = nblk > 1
//     nt = torch.get_num_threads(), at most nblk where parts
//     r = rstd.contiguous(); w = (weight or weight.reshape(d)).contiguous(); b likewise
//     dw = torch.empty_like(w); db = torch.empty_like(b)         # where needed
//     tmp = torch.empty((k * nblk + nt) * d, dtype=float64)      # where parts (k: dw, db needed)
//     C(dy, y, r, w, b, dx=dy, dw, db, scratch, dw_parts, db_parts, n, d, rpb, need..., nt); del tmp
// Returns (dx, dw, db) (dw and db in weight's and bias's shapes; None where not computed), or None
// (the caller runs its Python body) for a tensor subclass, a torch function or dispatch mode, or
// operands the Python body's kernel case does not take (other dtypes, devices, a non-contiguous y
// or dy, dy not of y's shape): checked before anything runs.
PyObject* layer_norm_bwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *pdy = nullptr, *py = nullptr, *prstd = nullptr, *pw = nullptr, *pb = nullptr;
  PyObject *pns = nullptr, *pfn = nullptr;
  int need_dx = 0, need_dw = 0, need_db = 0;
  long long min_rows = 0, max_blocks = 0;
  if (!PyArg_ParseTuple(
          args, "OOOOOOpppOLL", &pdy, &py, &prstd, &pw, &pb, &pns, &need_dx, &need_dw, &need_db,
          &pfn, &min_rows, &max_blocks)) {
    return nullptr;
  }
  auto fn = reinterpret_cast<LayerNormBwdF32>(PyLong_AsVoidPtr(pfn));
  if (PyErr_Occurred()) {
    return nullptr;
  }
  if (!PyList_Check(pns) && !PyTuple_Check(pns)) {
    Py_RETURN_NONE;
  }
  int64_t d = 1;
  const Py_ssize_t nd = PySequence_Fast_GET_SIZE(pns);
  for (Py_ssize_t i = 0; i < nd; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(pns, i);
    if (!PyLong_CheckExact(item)) {
      Py_RETURN_NONE;
    }
    d *= PyLong_AsLongLong(item);
  }
  if (PyErr_Occurred()) {
    return nullptr;
  }
  // dispatch modes (1) and torch function modes (2) see the Python body's calls
  if (fn == nullptr || min_rows < 1 || max_blocks < 1 || (slimgrad_watcher_mask() & 3) != 0) {
    Py_RETURN_NONE;
  }
  const bool has_w = pw != Py_None, has_b = pb != Py_None;
  if (const int ok = all_plain({pdy, py, prstd, pw, pb}, 3, true); ok <= 0) {
    if (ok < 0) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  const at::Tensor& dy = THPVariable_Unpack(pdy);
  const at::Tensor& y = THPVariable_Unpack(py);
  const at::Tensor& rstd = THPVariable_Unpack(prstd);
  at::Tensor weight, bias;
  if (has_w) {
    weight = THPVariable_Unpack(pw);
  }
  if (has_b) {
    bias = THPVariable_Unpack(pb);
  }
  // _bwd_cpu's kernel case, with out is dy (its caller checked dy's layout: owns_layout)
  if (dy.scalar_type() != at::kFloat || y.scalar_type() != at::kFloat ||
      rstd.scalar_type() != at::kFloat || !dy.is_cpu() || !y.is_cpu() || !rstd.is_cpu() ||
      !dy.sizes().equals(y.sizes()) || !dy.is_contiguous() || !y.is_contiguous() ||
      (has_w && (weight.scalar_type() != at::kFloat || !weight.is_cpu())) ||
      (has_b && (bias.scalar_type() != at::kFloat || !bias.is_cpu()))) {
    Py_RETURN_NONE;
  }
  const bool dw_needed = has_w && need_dw, db_needed = has_b && need_db;
  int64_t n = y.numel();
  n /= d > 1 ? d : 1;
  int64_t rpb = (n + max_blocks - 1) / max_blocks;
  if (rpb < min_rows) {
    rpb = min_rows;
  }
  const int64_t nblk = (n + rpb - 1) / rpb;
  int nt = at::get_num_threads();
  const bool parts = nblk > 1;
  if (parts && nt > nblk) {
    nt = static_cast<int>(nblk);
  }
  at::Tensor dx, dw, db;
  {
    NoGil nogil;
    if (need_dx) {
      dx = dy;
    }
    at::Tensor r = rstd.contiguous();
    at::Tensor w, b;
    if (has_w) {
      w = (weight.dim() == 1 ? weight : weight.reshape({d})).contiguous();
    }
    if (has_b) {
      b = (bias.dim() == 1 ? bias : bias.reshape({d})).contiguous();
    }
    if (dw_needed) {
      dw = at::empty_like(w);
    }
    if (db_needed) {
      db = at::empty_like(b);
    }
    const int k = static_cast<int>(dw_needed) + static_cast<int>(db_needed);
    at::Tensor tmp;
    char* base = nullptr;
    const int64_t part = nblk * d * 8;  // bytes of one parts buffer
    if (parts) {
      tmp = at::empty({(k * nblk + nt) * d}, at::TensorOptions().dtype(at::kDouble));
      base = static_cast<char*>(tmp.data_ptr());
    }
    float* dy_ptr = static_cast<float*>(dy.data_ptr());
    fn(dy_ptr, static_cast<const float*>(y.data_ptr()), static_cast<const float*>(r.data_ptr()),
       static_cast<const float*>(ptr_or_null(w)), static_cast<const float*>(ptr_or_null(b)),
       need_dx ? dy_ptr : nullptr, static_cast<float*>(const_cast<void*>(ptr_or_null(dw))),
       static_cast<float*>(const_cast<void*>(ptr_or_null(db))),
       parts ? reinterpret_cast<float*>(base + k * part) : nullptr,
       parts && dw_needed ? reinterpret_cast<double*>(base) : nullptr,
       parts && db_needed ? reinterpret_cast<double*>(base + (dw_needed ? part : 0)) : nullptr, n,
       d, rpb, need_dx ? 1 : 0, dw_needed ? 1 : 0, db_needed ? 1 : 0, nt);
    tmp.reset();
    if (dw_needed && weight.dim() != 1) {
      dw = dw.reshape(weight.sizes());
    }
    if (db_needed && bias.dim() != 1) {
      db = db.reshape(bias.sizes());
    }
  }
  return tensors_or_none({&dx, &dw, &db});
  END_HANDLE_TH_ERRORS
}

}  // namespace

// Added to the extension's module by storage_facts.cpp's init.
PyMethodDef slimgrad_backward_methods[] = {
    {"rms_norm_bwd", rms_norm_bwd, METH_VARARGS,
     "RMSNorm's one-chunk backward (slimgrad._math.norms.rms_norm_bwd_torch), else None."},
    {"gated_mlp_bwd", gated_mlp_bwd, METH_VARARGS,
     "The gated MLP's straight backward (slimgrad.ops.gated_mlp), else None."},
    {"layer_norm_bwd", layer_norm_bwd, METH_VARARGS,
     "LayerNorm's C-kernel backward over a granted dy (slimgrad.ops.layer_norm), else None."},
    {nullptr, nullptr, 0, nullptr}};

// ---- GPT-2's attention node's backward (slimgrad.ops.gpt2_attention) ----

#include <ATen/Parallel.h>

#include <limits>

namespace {

// kernels/cpu/dropout.c's dropout_bwd_f32, its address read once from the ctypes function that
// slimgrad.ops.dropout binds (the same C function the Python body calls through ctypes)
using DropoutBwdF32 = void (*)(const float*, const uint8_t*, float*, int64_t, float, int);

// gpt2_attention_bwd(dy, owned, bits_r, n_r, scale_r, a, w, need_a, need_w, need_b, q, k_t, v,
// bits_a, n_a, scale_a, causal_drop, need_q, need_k, need_v, b, h, t, d, dropout_bwd): the straight
// backward of slimgrad.ops.gpt2_attention._GPT2AttentionFn (NOTE [GPT-2's attention backward from
// C++] there), the Python body's ops in its order:
//     g = dy if owned else torch.empty_like(dy); C(dy, bits_r, g, n_r, scale_r)   # residual dropout
//     g2 = g.reshape(-1, g.shape[-1])                      # c_proj: HF Conv1D, weight (in, out)
//     da = torch.matmul(g2.view(b, t, out), w.mT); dw = a.reshape(-1, in).mT @ g2; db = g2.sum(0)
//     d_out = da.view(b, t, h, d).transpose(1, 2).reshape(b * h, t, d); del da
//     s = torch.bmm(q, k_t); s = torch.where(causal_drop, -inf, s)   # where causal
//     probs = torch._softmax(s, -1, False, out=s)
//     dp = torch.bmm(d_out, v.mT); C(dp, bits_a, dp, n_a, scale_a)
//     ds = torch._softmax_backward_data(dp, probs, -1, float32, grad_input=dp)
//     C(probs, bits_a, probs, n_a, scale_a); dv = torch.bmm(probs.mT, d_out); del probs
//     dq = torch.bmm(ds, k_t.mT); dk = torch.bmm(q.mT, ds)
// (each step only where its gradient is needed, as the Python body). Returns (dq, dk, dv, dw, db)
// with None where not computed, or None (the caller runs its Python body) for a tensor subclass, a
// torch function mode, a dy that is not a contiguous float32 tensor or operands of other shapes.
PyObject* gpt2_attention_bwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *pdy = nullptr, *pbits_r = nullptr, *pa = nullptr, *pw = nullptr, *pq = nullptr;
  PyObject *pk = nullptr, *pv = nullptr, *pbits_a = nullptr, *pdrop = nullptr, *pfn = nullptr;
  int owned = 0, need_a = 0, need_w = 0, need_b = 0, need_q = 0, need_k = 0, need_v = 0;
  long long n_r = 0, n_a = 0, b = 0, h = 0, t = 0, d = 0;
  double scale_r = 0.0, scale_a = 0.0;
  if (!PyArg_ParseTuple(
          args, "OpOLdOOpppOOOOLdOpppLLLLO", &pdy, &owned, &pbits_r, &n_r, &scale_r, &pa, &pw,
          &need_a, &need_w, &need_b, &pq, &pk, &pv, &pbits_a, &n_a, &scale_a, &pdrop, &need_q,
          &need_k, &need_v, &b, &h, &t, &d, &pfn)) {
    return nullptr;
  }
  auto fn = reinterpret_cast<DropoutBwdF32>(PyLong_AsVoidPtr(pfn));
  if (PyErr_Occurred()) {
    return nullptr;
  }
  if (fn == nullptr || at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NONE;
  }
  const bool causal = pdrop != Py_None;
  // a, w and causal_drop may be None: a where dw is not needed, w where da is not, causal_drop
  // without the causal fill
  const bool may_skip[9] = {false, false, !need_w, !need_a, false, false, false, false, true};
  PyObject* const objs[9] = {pdy, pbits_r, pa, pw, pq, pk, pv, pbits_a, pdrop};
  for (int i = 0; i < 9; ++i) {
    PyObject* o = objs[i];
    if (o == Py_None && may_skip[i]) {
      continue;
    }
    const int ok = plain(o, i == 3);
    if (ok <= 0) {
      if (ok < 0) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
  }
  const at::Tensor& dy = THPVariable_Unpack(pdy);
  const at::Tensor& bits_r = THPVariable_Unpack(pbits_r);
  const at::Tensor& q = THPVariable_Unpack(pq);
  const at::Tensor& k_t = THPVariable_Unpack(pk);
  const at::Tensor& v = THPVariable_Unpack(pv);
  const at::Tensor& bits_a = THPVariable_Unpack(pbits_a);
  at::Tensor a, w, drop;
  if (pa != Py_None) {
    a = THPVariable_Unpack(pa);
  }
  if (pw != Py_None) {
    w = THPVariable_Unpack(pw);
  }
  if (causal) {
    drop = THPVariable_Unpack(pdrop);
  }
  const int64_t bh = b * h;
  if (dy.scalar_type() != at::kFloat || !dy.is_contiguous() || dy.dim() != 3 ||
      dy.size(0) != b || dy.size(1) != t || dy.numel() != n_r ||
      bits_r.scalar_type() != at::kByte || bits_a.scalar_type() != at::kByte ||
      (need_a && (w.dim() != 2 || w.size(1) != dy.size(2) || w.size(0) != h * d)) ||
      (need_w && (a.dim() != 3 || a.size(0) != b || a.size(1) != t)) ||
      !q.sizes().equals({bh, t, d}) || !k_t.sizes().equals({bh, d, t}) ||
      !v.sizes().equals({bh, t, d}) || n_a != bh * t * t) {
    Py_RETURN_NONE;
  }
  const int nthreads = at::get_num_threads();
  at::Tensor dq, dk, dv, dw, db;
  {
    NoGil nogil;
    // the residual dropout's C pass, into dy where the caller owns it
    at::Tensor g = owned ? dy : at::empty_like(dy);
    fn(dy.data_ptr<float>(), bits_r.data_ptr<uint8_t>(), g.data_ptr<float>(), n_r,
       static_cast<float>(scale_r), nthreads);
    at::Tensor g2 = g.reshape({-1, g.size(-1)});
    g.reset();
    at::Tensor da;
    if (need_a) {
      da = at::matmul(g2.view({b, t, g2.size(1)}), w.mT());
    }
    if (need_w) {
      at::Tensor a2 = a.reshape({-1, a.size(-1)});
      dw = at::matmul(a2.mT(), g2);
    }
    if (need_b) {
      db = g2.sum({0}, false, c10::nullopt);
    }
    g2.reset();
    if (need_a) {
      at::Tensor d_out = da.view({b, t, h, d}).transpose(1, 2).reshape({bh, t, d});
      da.reset();
      at::Tensor s = at::bmm(q, k_t);
      if (causal) {
        s = at::where(drop, at::Scalar(-std::numeric_limits<double>::infinity()), s);
      }
      at::Tensor probs = at::_softmax_out(s, s, -1, false);
      s.reset();
      const float sa = static_cast<float>(scale_a);
      const uint8_t* bits = bits_a.data_ptr<uint8_t>();
      at::Tensor ds;
      if (need_q || need_k) {
        at::Tensor dp = at::bmm(d_out, v.mT());
        float* ptr = dp.data_ptr<float>();
        fn(ptr, bits, ptr, n_a, sa, nthreads);
        ds = at::_softmax_backward_data_out(dp, dp, probs, -1, probs.scalar_type());
      }
      if (need_v) {
        float* ptr = probs.data_ptr<float>();
        fn(ptr, bits, ptr, n_a, sa, nthreads);
        dv = at::bmm(probs.mT(), d_out);
      }
      probs.reset();
      if (need_q) {
        dq = at::bmm(ds, k_t.mT());
      }
      if (need_k) {
        dk = at::bmm(q.mT(), ds);
      }
    }
  }
  return tensors_or_none({&dq, &dk, &dv, &dw, &db});
  END_HANDLE_TH_ERRORS
}

// conv1d_bwd(dy, x, w, need_x, need_w, need_b): slimgrad.ops.linear._LinearFn's first-order
// backward for an HF Conv1D (weight (in, out)) on an input of 3 or more dims (NOTE [Linear's 2-D
// product] there), as GPT-2's ln_1 + c_attn node runs it (NOTE [GPT-2's attention backward from
// C++] in ops/gpt2_attention.py):
//     g2 = dy.reshape(-1, dy.shape[-1])
//     dx = torch.matmul(g2.view(dy.shape[:-1] + g2.shape[1:]), w.mT)
//     dw = x.reshape(-1, x.shape[-1]).mT @ g2; db = g2.sum(0)
// (each where needed). Returns (dx, dw, db) with None where not computed, or None (the caller runs
// its Python body) for a tensor subclass, a torch function mode or operands of other ranks.
PyObject* conv1d_bwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *pdy = nullptr, *px = nullptr, *pw = nullptr;
  int need_x = 0, need_w = 0, need_b = 0;
  if (!PyArg_ParseTuple(args, "OOOppp", &pdy, &px, &pw, &need_x, &need_w, &need_b)) {
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NONE;
  }
  const bool may_skip[3] = {false, !need_w, !need_x};
  PyObject* const objs[3] = {pdy, px, pw};
  for (int i = 0; i < 3; ++i) {
    PyObject* o = objs[i];
    if (o == Py_None && may_skip[i]) {
      continue;
    }
    const int ok = plain(o, i == 2);
    if (ok <= 0) {
      if (ok < 0) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
  }
  const at::Tensor& dy = THPVariable_Unpack(pdy);
  at::Tensor x, w;
  if (px != Py_None) {
    x = THPVariable_Unpack(px);
  }
  if (pw != Py_None) {
    w = THPVariable_Unpack(pw);
  }
  if (dy.dim() < 3 || (need_x && w.dim() != 2) || (need_w && x.dim() != dy.dim())) {
    Py_RETURN_NONE;
  }
  at::Tensor dx, dw, db;
  {
    NoGil nogil;
    at::Tensor g2 = dy.reshape({-1, dy.size(-1)});
    if (need_x) {
      std::vector<int64_t> shape(dy.sizes().begin(), dy.sizes().end() - 1);
      shape.push_back(g2.size(1));
      dx = at::matmul(g2.view(shape), w.mT());
    }
    if (need_w) {
      at::Tensor x2 = x.reshape({-1, x.size(-1)});
      dw = at::matmul(x2.mT(), g2);
    }
    if (need_b) {
      db = g2.sum({0}, false, c10::nullopt);
    }
  }
  return tensors_or_none({&dx, &dw, &db});
  END_HANDLE_TH_ERRORS
}

// kernels/cpu/dropout.c's dropout_fwd_f32 (noise, x, out, bits, n, scale, threads), as above
using DropoutFwdF32 = void (*)(float*, const float*, float*, uint8_t*, int64_t, float, int);

// eager's draw, then the C pass (pack + x * noise into the noise): slimgrad.ops.dropout's
// _straight_c on a contiguous float32 CPU x
at::Tensor dropout_c_fwd(
    DropoutFwdF32 fn, const at::Tensor& x, double p, double scale, int nthreads,
    at::Tensor& bits) {
  at::Tensor out = at::empty_like(x).bernoulli_(1 - p);
  const int64_t n = x.numel();
  bits = at::empty({(n + 7) / 8}, at::TensorOptions().dtype(at::kByte));
  float* ptr = out.data_ptr<float>();
  fn(ptr, x.data_ptr<float>(), ptr, bits.data_ptr<uint8_t>(), n, static_cast<float>(scale),
     nthreads);
  return out;
}

// gpt2_attention_fwd(q, k_t, v, w, b, p_attn, scale_a, causal_drop, p_resid, scale_r, bb, h, t, d,
// dropout_fwd): _GPT2AttentionFn's forward where every step takes its straight path on the dropout
// C kernels (NOTE [GPT-2's attention node's forward from C++] in ops/gpt2_attention.py):
//     s = torch.bmm(q, k_t); s = torch.where(causal_drop, -inf, s)   # where causal
//     probs = torch._softmax(s, -1, False, out=s)
//     dropped, bits_a = _straight_c(probs, p_attn); out = torch.bmm(dropped, v)
//     a = out.view(bb, h, t, d).transpose(1, 2).contiguous().reshape(bb, t, h * d)
//     z = torch.addmm(b, a.view(-1, h * d), w).view(bb, t, -1)
//     y, bits_r = _straight_c(z, p_resid)
// Returns (y, bits_a, a, bits_r), or None (the caller runs its Python steps) for a tensor
// subclass, a torch function mode, or operands of other dtypes, shapes or layouts.
PyObject* gpt2_attention_fwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *pq = nullptr, *pk = nullptr, *pv = nullptr, *pw = nullptr, *pb = nullptr;
  PyObject *pdrop = nullptr, *pfn = nullptr;
  double p_attn = 0.0, scale_a = 0.0, p_resid = 0.0, scale_r = 0.0;
  long long bb = 0, h = 0, t = 0, d = 0;
  if (!PyArg_ParseTuple(
          args, "OOOOOddOddLLLLO", &pq, &pk, &pv, &pw, &pb, &p_attn, &scale_a, &pdrop, &p_resid,
          &scale_r, &bb, &h, &t, &d, &pfn)) {
    return nullptr;
  }
  auto fn = reinterpret_cast<DropoutFwdF32>(PyLong_AsVoidPtr(pfn));
  if (PyErr_Occurred()) {
    return nullptr;
  }
  if (fn == nullptr || at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NONE;
  }
  const bool causal = pdrop != Py_None;
  PyObject* const objs[6] = {pq, pk, pv, pw, pb, pdrop};
  for (int i = 0; i < 6; ++i) {
    if (i == 5 && !causal) {
      continue;
    }
    const int ok = plain(objs[i], i == 3 || i == 4);
    if (ok <= 0) {
      if (ok < 0) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
  }
  const at::Tensor& q = THPVariable_Unpack(pq);
  const at::Tensor& k_t = THPVariable_Unpack(pk);
  const at::Tensor& v = THPVariable_Unpack(pv);
  const at::Tensor& w = THPVariable_Unpack(pw);
  const at::Tensor& b = THPVariable_Unpack(pb);
  at::Tensor drop;
  if (causal) {
    drop = THPVariable_Unpack(pdrop);
  }
  const int64_t bh = bb * h;
  for (const at::Tensor* x : {&q, &k_t, &v, &w, &b}) {
    if (x->scalar_type() != at::kFloat || !x->is_cpu()) {
      Py_RETURN_NONE;
    }
  }
  if (!q.sizes().equals({bh, t, d}) || !k_t.sizes().equals({bh, d, t}) ||
      !v.sizes().equals({bh, t, d}) || w.dim() != 2 || w.size(0) != h * d || b.dim() != 1 ||
      b.size(0) != w.size(1)) {
    Py_RETURN_NONE;
  }
  const int nthreads = at::get_num_threads();
  at::Tensor y, bits_a, a, bits_r;
  {
    NoGil nogil;
    at::Tensor s = at::bmm(q, k_t);
    if (causal) {
      s = at::where(drop, at::Scalar(-std::numeric_limits<double>::infinity()), s);
    }
    at::Tensor probs = at::_softmax_out(s, s, -1, false);
    s.reset();
    at::Tensor dropped = dropout_c_fwd(fn, probs, p_attn, scale_a, nthreads, bits_a);
    at::Tensor out = at::bmm(dropped, v);
    dropped.reset();
    probs.reset();  // after the product, as the Python body's ``del s, probs``: the same peak
    a = out.view({bb, h, t, d}).transpose(1, 2).contiguous().reshape({bb, t, h * d});
    out.reset();
    at::Tensor z = at::addmm(b, a.view({-1, a.size(-1)}), w);
    z = z.view({bb, t, z.size(-1)});
    y = dropout_c_fwd(fn, z, p_resid, scale_r, nthreads, bits_r);
  }
  return Py_BuildValue(
      "(NNNN)",
      THPVariable_Wrap(std::move(y)),
      THPVariable_Wrap(std::move(bits_a)),
      THPVariable_Wrap(std::move(a)),
      THPVariable_Wrap(std::move(bits_r)));
  END_HANDLE_TH_ERRORS
}

}  // namespace

namespace {
PyObject* gpt2_mlp_bwd(PyObject* self, PyObject* args);  // defined at the end of this file
}  // namespace

// Added to the extension's module by storage_facts.cpp's init, after slimgrad_backward_methods.
PyMethodDef slimgrad_gpt2_backward_methods[] = {
    {"gpt2_attention_bwd", gpt2_attention_bwd, METH_VARARGS,
     "GPT-2's attention node's straight backward (slimgrad.ops.gpt2_attention), else None."},
    {"gpt2_attention_fwd", gpt2_attention_fwd, METH_VARARGS,
     "GPT-2's attention node's straight forward (slimgrad.ops.gpt2_attention), else None."},
    {"conv1d_bwd", conv1d_bwd, METH_VARARGS,
     "An HF Conv1D's backward on a 3+-D input (slimgrad.ops.gpt2_attention), else None."},
    {"gpt2_mlp_bwd", gpt2_mlp_bwd, METH_VARARGS,
     "GPT-2's MLP node's straight backward (slimgrad.ops.gpt2_mlp), else None."},
    {nullptr, nullptr, 0, nullptr}};

// ---- GPT-2's MLP node's backward (slimgrad.ops.gpt2_mlp) ----

namespace {

// output_act.c's smooth_bwd_f32, its address read once from the ctypes function the GELU's C path
// (slimgrad.ops._output_act.CPath) calls
using SmoothBwdF32 = void (*)(const float*, const float*, const uint8_t*, const float*, float*,
                              int64_t, int64_t, float, float, float, float, float, int);

// gpt2_mlp_bwd(dy, owned, bits_r, n_r, scale_r, dropout_bwd, y, w_proj, need_h, need_wp, need_bp,
// act_y, act_bits, idx, xs, act_n, smooth_bwd, tab, tn, y_hi, y_lo, s2max, sc_r, sc_l,
// approximate, x, w_fc, need_x, need_wf, need_bf): the MLP steps' straight float32 CPU backward
// of slimgrad.ops.gpt2_mlp._mlp_backward (NOTE [GPT-2's MLP backward from C++] there), the Python
// body's ops in its order:
//     g = dy if owned else torch.empty_like(dy); C(dy, bits_r, g, n_r, scale_r)  # dropout, if any
//     g2 = g.reshape(-1, D); del g                   # c_proj: HF Conv1D, weight (in, out)
//     dh = torch.matmul(g2.view(lead + (D,)), w_proj.mT); dwp = y.reshape(-1, H).mT @ g2
//     dbp = g2.sum(0); del g2
//     gf = dh.view(-1); gh = gf.index_select(0, idx)      # the GELU's C path into dh, k hard
//     S(gf, act_y, act_bits, tab, gf, act_n, ...)         # elements (k = 0: neither op)
//     gf.index_put_((idx,), torch.ops.aten.gelu_backward(gh, xs, approximate=approximate))
//     dh2 = dh.reshape(-1, H)                               # c_fc
//     dx = torch.matmul(dh2.view(lead + (H,)), w_fc.mT); dwf = x.reshape(-1, C).mT @ dh2
//     dbf = dh2.sum(0)
// (each step only where its gradient is needed, as the Python body; dropout_bwd 0: no dropout).
// Returns (dx, dwf, dbf, dwp, dbp) with None where not computed, or None (the caller runs its
// Python body) for a tensor subclass, a torch function mode, a dy that is not a contiguous
// float32 CPU tensor, or saved tensors of other dtypes, shapes or layouts (checked before any op
// runs: nothing is written where None comes back).
PyObject* gpt2_mlp_bwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *pdy = nullptr, *pbits_r = nullptr, *pdfn = nullptr, *pyp = nullptr, *pwp = nullptr;
  PyObject *pay = nullptr, *pabits = nullptr, *pidx = nullptr, *pxs = nullptr, *pgfn = nullptr;
  PyObject *ptab = nullptr, *px = nullptr, *pwf = nullptr;
  int owned = 0, need_h = 0, need_wp = 0, need_bp = 0, need_x = 0, need_wf = 0, need_bf = 0;
  long long n_r = 0, act_n = 0, tn = 0;
  double scale_r = 0.0, y_hi = 0.0, y_lo = 0.0, s2max = 0.0, sc_r = 0.0, sc_l = 0.0;
  const char* approx = nullptr;
  if (!PyArg_ParseTuple(
          args, "OpOLdOOOpppOOOOLOOLdddddsOOppp", &pdy, &owned, &pbits_r, &n_r, &scale_r, &pdfn,
          &pyp, &pwp, &need_h, &need_wp, &need_bp, &pay, &pabits, &pidx, &pxs, &act_n, &pgfn,
          &ptab, &tn, &y_hi, &y_lo, &s2max, &sc_r, &sc_l, &approx, &px, &pwf, &need_x, &need_wf,
          &need_bf)) {
    return nullptr;
  }
  auto dfn = reinterpret_cast<DropoutBwdF32>(PyLong_AsVoidPtr(pdfn));
  if (PyErr_Occurred()) {
    return nullptr;
  }
  SmoothBwdF32 gfn = nullptr;
  const float* tab = nullptr;
  if (need_h) {
    gfn = reinterpret_cast<SmoothBwdF32>(PyLong_AsVoidPtr(pgfn));
    tab = static_cast<const float*>(PyLong_AsVoidPtr(ptab));
    if (PyErr_Occurred()) {
      return nullptr;
    }
    if (gfn == nullptr || tab == nullptr) {
      Py_RETURN_NONE;
    }
  }
  const std::string approximate(approx);
  if (at::impl::torch_function_mode_enabled() ||
      (approximate != "none" && approximate != "tanh")) {
    Py_RETURN_NONE;
  }
  const bool drop = dfn != nullptr;
  // operands that may be None: bits_r without dropout, y where dwp is not needed, w_proj and the
  // GELU's and c_fc's tensors where dh is not, x where dwf is not, w_fc where dx is not
  const bool may_skip[10] = {false,   !drop,   !need_wp, !need_h,           !need_h,
                             !need_h, !need_h, !need_h, !need_h || !need_wf, !need_h || !need_x};
  PyObject* const objs[10] = {pdy, pbits_r, pyp, pwp, pay, pabits, pidx, pxs, px, pwf};
  at::Tensor t[10];
  for (int i = 0; i < 10; ++i) {
    PyObject* o = objs[i];
    if (o == Py_None && may_skip[i]) {
      continue;
    }
    const int ok = plain(o, i == 3 || i == 9);
    if (ok <= 0) {
      if (ok < 0) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
    t[i] = THPVariable_Unpack(o);
  }
  const at::Tensor& dy = t[0];
  const at::Tensor &bits_r = t[1], &y = t[2], &w_proj = t[3], &act_y = t[4], &act_bits = t[5];
  const at::Tensor &idx = t[6], &xs = t[7], &x = t[8], &w_fc = t[9];
  if (dy.scalar_type() != at::kFloat || !dy.is_cpu() || !dy.is_contiguous() || dy.dim() < 3) {
    Py_RETURN_NONE;
  }
  if (drop && (bits_r.scalar_type() != at::kByte || dy.numel() != n_r)) {
    Py_RETURN_NONE;
  }
  const int64_t dd = dy.size(-1);
  std::vector<int64_t> lead(dy.sizes().begin(), dy.sizes().end() - 1);
  int64_t hd = -1;  // h's width
  if (need_h) {
    hd = w_proj.size(0);
    std::vector<int64_t> hshape = lead;
    hshape.push_back(hd);
    // c_backward's checks (slimgrad.ops._output_act), before anything runs
    if (w_proj.dim() != 2 || w_proj.size(1) != dd || act_y.scalar_type() != at::kFloat ||
        !act_y.is_cpu() || !act_y.sizes().equals(hshape) || !act_y.is_contiguous() ||
        !act_bits.is_contiguous() || idx.dim() != 1 || xs.dim() != 1 ||
        xs.size(0) != idx.size(0) || act_n != act_y.numel()) {
      Py_RETURN_NONE;
    }
    if (need_x && (w_fc.dim() != 2 || w_fc.size(1) != hd)) {
      Py_RETURN_NONE;
    }
    if (need_wf && x.dim() != dy.dim()) {
      Py_RETURN_NONE;
    }
  }
  if (need_wp && y.dim() != dy.dim()) {
    Py_RETURN_NONE;
  }
  const int nthreads = at::get_num_threads();
  at::Tensor dx, dwf, dbf, dwp, dbp;
  {
    NoGil nogil;
    at::Tensor g = dy;
    if (drop) {  // the residual dropout's C pass, into dy where the caller owns it
      if (!owned) {
        g = at::empty_like(dy);
      }
      dfn(dy.data_ptr<float>(), bits_r.data_ptr<uint8_t>(), g.data_ptr<float>(), n_r,
          static_cast<float>(scale_r), nthreads);
    }
    at::Tensor g2 = g.reshape({-1, dd});
    g.reset();
    at::Tensor dh;
    if (need_h) {
      std::vector<int64_t> shape = lead;
      shape.push_back(dd);
      dh = at::matmul(g2.view(shape), w_proj.mT());
    }
    if (need_wp) {
      at::Tensor y2 = y.reshape({-1, y.size(-1)});
      dwp = at::matmul(y2.mT(), g2);
    }
    if (need_bp) {
      dbp = g2.sum({0}, false, c10::nullopt);
    }
    g2.reset();
    if (need_h) {
      TORCH_CHECK(
          dh.is_contiguous(),
          "slimgrad.ops.gpt2_mlp: c_proj's dx is not contiguous; this is a slimgrad bug; please "
          "report it");
      // the GELU's C path (c_backward), into dh: made here, nobody else holds it
      at::Tensor gf = dh.view({-1});
      const int64_t k = idx.size(0);
      at::Tensor gh;
      if (k) {  // the hard elements' g, read before gf is written
        gh = gf.index_select(0, idx);
      }
      float* gp = gf.data_ptr<float>();
      gfn(gp, act_y.data_ptr<float>(), act_bits.data_ptr<uint8_t>(), tab, gp, act_n, tn,
          static_cast<float>(y_hi), static_cast<float>(y_lo), static_cast<float>(s2max),
          static_cast<float>(sc_r), static_cast<float>(sc_l), nthreads);
      if (k) {
        at::Tensor ex = at::gelu_backward(gh, xs, approximate);
        c10::List<std::optional<at::Tensor>> ind;
        ind.push_back(idx);
        gf.index_put_(ind, ex);
        ex.reset();  // the temporary first, then gh (c_backward's local, at its return)
        gh.reset();
      }
      gf.reset();
      at::Tensor dh2 = dh.reshape({-1, hd});
      dh.reset();
      if (need_x) {
        std::vector<int64_t> shape = lead;
        shape.push_back(hd);
        dx = at::matmul(dh2.view(shape), w_fc.mT());
      }
      if (need_wf) {
        at::Tensor x2 = x.reshape({-1, x.size(-1)});
        dwf = at::matmul(x2.mT(), dh2);
      }
      if (need_bf) {
        dbf = dh2.sum({0}, false, c10::nullopt);
      }
    }
  }
  return tensors_or_none({&dx, &dwf, &dbf, &dwp, &dbp});
  END_HANDLE_TH_ERRORS
}

}  // namespace
