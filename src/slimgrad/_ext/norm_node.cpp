// A C++ autograd node for the HF Llama RMSNorm's from-output path (NOTE [The RMSNorm node in C++]
// in slimgrad/ops/rms_norm.py): the forward issues the ATen ops of _HFRMSNormFromOutputFn's
// straight forward, saves what it saves (y, rstd, the weight), and its backward issues
// rms_norm_bwd_torch's one-chunk body (backward.cpp's, NOTE [Backward bodies from C++]) after
// deciding from the TensorImpl's and storage's counts whether it may write dx over dy (NOTE
// [Gradient-buffer ownership] in slimgrad/ownership.py, asked in C++: NOTE [dy's ownership asked by
// the C++ node] below). Whatever it does not cover runs the Python code: the entry returns None
// (the caller applies the Python Function), and the backward calls the Python tail registered with
// ``set_norm_fallbacks`` (a watcher in backward, a body that does not apply, create_graph).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/ScalarOps.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

long slimgrad_watcher_mask();                  // storage_facts.cpp
int slimgrad_torch_owned(const c10::Storage& s);  // storage_facts.cpp (term 7)
int slimgrad_has_weakrefs(PyObject* obj);         // storage_facts.cpp: 1, 0, -1 (error set)
// backward.cpp: rms_norm_bwd's checks and body on tensors (false: its case does not hold)
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
    at::Tensor& dw);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// NOTE [dy's ownership asked by the C++ node]
// The node asks NOTE [Gradient-buffer ownership]'s terms about its incoming gradient dy without a
// Python frame, so term 3 (the Python reference count against the calling chain's baseline) has no
// frame to read; its job, catching Python holders of the same object, is done from the object
// itself. On torch 2.13 a tensor's Python object, once made, holds one use of its TensorImpl, and
// while any C++ handle is alive the TensorImpl keeps one reference to the object (NOTE [PyObject
// preservation for Tensor and Storages] in c10's intrusive_ptr.h): so the object's reference count
// is 1 unless Python holds it (a hook or a list keeping dy), read under the GIL where an object
// exists. The node moves dy out of the engine's argument list, so a dy nobody else holds has use
// count 1, plus 1 where it has a Python object (term 1; a sibling pending on the same gradient, a
// captured gradient, a user ``gradient=``, a SavedVariable of an upstream node each add one).
// Python weak references (term 2's last part) are read from an existing Python
// object under the GIL (no object is made). Terms 2a/2b compare the storage's use and weak counts
// with a fresh tensor's, read once from a probe as ownership.py does; a storage object passes
// where only PyTorch keeps it (refused where it has any weak reference: ownership.py also lets
// slimgrad.memory's finalizers pass, which a backward measured alone may add; a few more bytes
// there, the same bits). Terms 4-7 as ownership.py. The switches ownership.py reads per question
// are kept in sync: ``reuse_disabled`` through ``set_reuse_off`` (process-wide, as the depth
// there), ``SLIMGRAD_NO_REUSE`` read as it does (getenv; os.environ writes through putenv), and
// grants only where ownership.py's own facts loaded (``set_norm_grants``); each grant counts in
// ``ownership.reuse_count("grad")`` through ``node_grants``.
std::atomic<int> g_reuse_off{0};
std::atomic<int> g_grants_allowed{0};
std::atomic<long long> g_grants{0};
int64_t g_fresh_storage_use = -1;  // a fresh tensor's storage use and weak counts (probe)
int64_t g_fresh_storage_weak = -1;

PyObject* g_fallback = nullptr;  // _node_fallback(dy, y, rstd, w, own, need_x, need_w)
PyObject* g_double = nullptr;    // _node_double(dy, y, rstd, w, eps, need_x, need_w, box)
PyObject* g_written = nullptr;   // _node_written(message): raises slimgrad's error, or returns
PyObject* g_box_type = nullptr;  // GradBox: a node's box, made by the first double through it

// The node's GradBox (NOTE [A second-order pass's gradient handed to its node] in
// slimgrad/ops/layer_norm.py): a slot saved in forward, empty until a double through the node
// makes the box (under the GIL); every backward reads it with one atomic load. The slot is the
// node's, so the box dies with the node's graph.
struct BoxSlot : torch::CustomClassHolder {
  std::atomic<PyObject*> box{nullptr};
  ~BoxSlot() override {
    PyObject* b = box.load();
    if (b != nullptr && Py_IsInitialized() != 0) {
      PyGILState_STATE st = PyGILState_Ensure();
      Py_DECREF(b);
      PyGILState_Release(st);
    }
  }
};

bool env_off() {
  const char* v = std::getenv("SLIMGRAD_NO_REUSE");
  if (v == nullptr) {
    return false;
  }
  // ownership._env_disabled: stripped, lower-cased, not one of "", 0, false, no, off
  std::string s(v);
  const auto b = s.find_first_not_of(" \t\n\r\f\v");
  if (b == std::string::npos) {
    return false;
  }
  s = s.substr(b, s.find_last_not_of(" \t\n\r\f\v") - b + 1);
  for (auto& c : s) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return !(s == "0" || s == "false" || s == "no" || s == "off");
}

bool functorch_watching() {
  return (slimgrad_watcher_mask() & 4) != 0;
}

// The Python side of a TensorImpl nobody else holds: 1 where it has no Python object, or one
// that is exactly torch.Tensor, has no weak reference (weakref.getweakrefcount, as ownership.py
// asks) and no Python holder (its reference count is the one the TensorImpl's other C++ uses
// keep, NOTE [PyObject preservation for Tensor and Storages] in c10's intrusive_ptr.h); 0 where
// not; -1: a Python error (set, fetched with the GIL). ``*obj_use``: the TensorImpl use the object
// holds (0 or 1). Takes the GIL only where there is an object.
int python_side_ok(const at::TensorBase& t, int64_t* obj_use) {
  PyObject* obj = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  *obj_use = obj != nullptr ? 1 : 0;
  if (obj == nullptr) {
    return 1;
  }
  PyGILState_STATE st = PyGILState_Ensure();
  int ok = (THPVariable_CheckExact(obj) && Py_REFCNT(obj) == 1) ? 1 : 0;
  if (ok) {
    const int weak = slimgrad_has_weakrefs(obj);
    ok = weak < 0 ? -1 : (weak == 0 ? 1 : 0);
  }
  PyGILState_Release(st);
  return ok;
}

[[noreturn]] void raise_python() {
  python_error err;
  err.persist();
  throw std::move(err);
}

BoxSlot* box_slot(AutogradContext* ctx) {
  return static_cast<BoxSlot*>(ctx->saved_data.at("box").toCapsule().get());
}

// The slot's box, made where there is none yet (with the GIL; the first box stored wins, as the
// Python ctx_box's lock makes it).
PyObject* box_made(BoxSlot* slot) {
  PyObject* b = slot->box.load(std::memory_order_acquire);
  if (b != nullptr) {
    return b;
  }
  PyObject* fresh = PyObject_CallNoArgs(g_box_type);
  if (fresh == nullptr) {
    raise_python();
  }
  PyObject* expected = nullptr;
  if (!slot->box.compare_exchange_strong(expected, fresh, std::memory_order_acq_rel)) {
    Py_DECREF(fresh);  // made meanwhile (the call can switch threads)
    return expected;
  }
  return fresh;
}

bool plain_keys(const at::TensorBase& t) {
  const c10::DispatchKeySet ks = t.key_set();
  return !(ks.has(c10::DispatchKey::FuncTorchGradWrapper) ||
           ks.has(c10::DispatchKey::FuncTorchBatched) ||
           ks.has(c10::DispatchKey::Functionalize) || ks.has(c10::DispatchKey::Python));
}

// Terms 2a/2b's storage: no holder but dy and ``extra`` known TensorImpls (a view's base), no C++
// weak reference; one use more only where it is the storage object PyTorch keeps alive with the
// storage once one was made, and nobody holds it or a weak reference to it (ownership.py's
// _storage_free; the object's count read here holds no reference of ours, so only the one the
// storage's other use keeps shows, NOTE [PyObject preservation for Tensor and Storages]). 1 yes,
// 0 no, -1 a Python error (set).
int storage_counts(const c10::Storage& s, int64_t extra) {
  c10::StorageImpl* impl = s.unsafeGetStorageImpl();
  if (impl == nullptr) {
    return 0;
  }
  const int64_t weak = static_cast<int64_t>(s.getWeakStorageImpl().weak_use_count()) - 1;
  if (weak != g_fresh_storage_weak) {
    return 0;
  }
  const int64_t use = static_cast<int64_t>(s.use_count());
  PyObject* obj = impl->pyobj_slot()->load_pyobj();
  if (obj == nullptr) {
    return use == g_fresh_storage_use + extra ? 1 : 0;
  }
  if (use != g_fresh_storage_use + extra + 1) {
    return 0;
  }
  PyGILState_STATE st = PyGILState_Ensure();
  int ok = Py_REFCNT(obj) == 1 ? 1 : 0;
  if (ok) {
    const int w = slimgrad_has_weakrefs(obj);
    ok = w < 0 ? -1 : (w == 0 ? 1 : 0);
  }
  PyGILState_Release(st);
  return ok;
}

// Whether the node may write over dy (held by the caller's one local): NOTE [dy's ownership
// asked by the C++ node]. Counts a grant.
bool grant_dy(const at::Tensor& dy) {
  if (!g_grants_allowed.load(std::memory_order_relaxed) ||
      g_reuse_off.load(std::memory_order_relaxed) || !dy.defined()) {
    return false;
  }
  // terms 5-6: no grad mode, inside the engine, no functorch; not requiring grad
  if (c10::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() == -1 ||
      dy.requires_grad() || functorch_watching()) {
    return false;
  }
  // term 4
  if (!dy.has_storage() || dy.layout() != c10::kStrided || dy.is_nested() || dy.is_conj() ||
      dy.is_neg() || dy.numel() == 0 || dy.storage_offset() != 0 || !plain_keys(dy)) {
    return false;
  }
  const c10::Storage& s = dy.storage();
  if (static_cast<size_t>(dy.numel()) * dy.element_size() != s.nbytes() ||
      !dy.unsafeGetTensorImpl()->is_non_overlapping_and_dense()) {
    return false;
  }
  // term 7
  if (slimgrad_torch_owned(s) != 1) {
    return false;
  }
  // term 1 (and term 3's Python holders): the caller's handle, and the Python object's if any
  int64_t obj_use = 0;
  const int p = python_side_ok(dy, &obj_use);
  if (p != 1) {
    if (p < 0) {
      raise_python();
    }
    return false;
  }
  if (static_cast<int64_t>(dy.use_count()) != 1 + obj_use) {
    return false;
  }
  const bool view = dy.is_view();
  if (view) {  // term 2b: a whole-storage view whose base only the view holds
    const at::TensorBase& base = dy._base();
    if (!base.defined() || base.is_view() || base.requires_grad() ||
        base.unsafeGetTensorImpl()->grad().defined() || base.grad_fn() != nullptr ||
        base.layout() != c10::kStrided || base.is_nested() || base.device() != dy.device() ||
        !plain_keys(base) || !base.has_storage() ||
        base.storage().unsafeGetStorageImpl() != s.unsafeGetStorageImpl()) {
      return false;
    }
    int64_t base_obj = 0;
    const int b = python_side_ok(base, &base_obj);
    if (b != 1) {
      if (b < 0) {
        raise_python();
      }
      return false;
    }
    if (static_cast<int64_t>(base.use_count()) != 1 + base_obj) {  // the view's handle
      return false;
    }
  }
  const int free = storage_counts(s, view ? 1 : 0);  // terms 2a/2b
  if (free != 1) {
    if (free < 0) {
      raise_python();
    }
    return false;
  }
  if (env_off()) {
    return false;
  }
  g_grants.fetch_add(1, std::memory_order_relaxed);
  return true;
}

at::Tensor wrapped_double(double v) {
  at::Tensor s = at::scalar_to_tensor(at::Scalar(v));
  s.unsafeGetTensorImpl()->set_wrapped_number(true);
  return s;
}

// Calls a registered Python tail with the GIL: returns its two results (dx or None, dw or None).
void call_python(PyObject* fn, PyObject* args, at::Tensor& dx, at::Tensor& dw) {
  if (args == nullptr) {
    raise_python();
  }
  PyObject* r = PyObject_CallObject(fn, args);
  Py_DECREF(args);
  if (r == nullptr) {
    raise_python();
  }
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < 2) {
    Py_DECREF(r);
    PyErr_SetString(
        PyExc_RuntimeError,
        "slimgrad._ext.norm_node: the Python tail returned no (dx, dw) pair; this is a slimgrad "
        "bug; please report it");
    raise_python();
  }
  PyObject* a = PyTuple_GET_ITEM(r, 0);
  PyObject* b = PyTuple_GET_ITEM(r, 1);
  if (a != Py_None) {
    dx = THPVariable_Unpack(a);
  }
  if (b != Py_None) {
    dw = THPVariable_Unpack(b);
  }
  Py_DECREF(r);
}

// The node's saved tensors; autograd's error for a saved tensor written after forward goes to the
// Python ``_node_written`` first, which raises slimgrad's error where the tensor is the node's
// output y (NOTE [A norm's output written after forward] in slimgrad/ops/layer_norm.py, as the
// Python Function's backward does); any other error (a written weight) stays autograd's.
variable_list saved_or_raise(AutogradContext* ctx) {
  try {
    return ctx->get_saved_variables();
  } catch (const c10::Error& e) {
    if (g_written == nullptr) {
      throw;
    }
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject* r = PyObject_CallFunction(g_written, "s", e.what_without_backtrace());
    if (r == nullptr) {
      python_error err;
      err.persist();
      PyGILState_Release(st);
      throw std::move(err);
    }
    Py_DECREF(r);
    PyGILState_Release(st);
    throw;
  }
}

struct HFRMSNormNode : public torch::autograd::Function<HFRMSNormNode> {
  // _HFRMSNormFromOutputFn.forward's straight Llama branch:
  //     rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps); y = weight * (x * rstd)
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& weight,
      double eps,
      int64_t chunk) {
    at::Tensor p = at::pow(x, at::Scalar(static_cast<int64_t>(2)));
    at::Tensor m = at::mean(p, {-1}, true);
    p.reset();
    at::Tensor a = at::add(m, wrapped_double(eps));
    m.reset();
    at::Tensor rstd = at::rsqrt(a);
    a.reset();
    at::Tensor n = at::mul(x, rstd);
    at::Tensor y = at::mul(weight, n);
    n.reset();
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({y, rstd, weight});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["eps"] = eps;
    // ctx.needs_input_grad as the Python Function has it: requires_grad at forward (the
    // engine's per-task needs would skip dw under ``inputs=``/``autograd.grad``: other ops)
    ctx->saved_data["need_x"] = x.requires_grad();
    ctx->saved_data["need_w"] = weight.requires_grad();
    ctx->saved_data["box"] = c10::IValue::make_capsule(c10::make_intrusive<BoxSlot>());
    return y;
  }

  // grads by reference: dy is moved out of the engine's list, so this frame holds its only
  // handle (NOTE [dy's ownership asked by the C++ node])
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    at::Tensor dy = std::move(grads[0]);
    // NOTE [A second-order pass's gradient handed to its node] in slimgrad/ops/layer_norm.py:
    // where a double made the node's box, this pass's entry (if any) is added to dx
    BoxSlot* slot = box_slot(ctx);
    PyObject* box = slot->box.load(std::memory_order_acquire);
    if (box == nullptr) {
      return body(ctx, dy, slot);
    }
    at::Tensor extra;
    {
      PyGILState_STATE st = PyGILState_Ensure();
      PyObject* r = PyObject_CallMethod(box, "take", nullptr);
      if (r == nullptr) {
        python_error err;
        err.persist();
        PyGILState_Release(st);
        throw std::move(err);
      }
      if (r != Py_None) {
        extra = THPVariable_Unpack(r);
      }
      Py_DECREF(r);
      PyGILState_Release(st);
    }
    variable_list out = body(ctx, dy, slot);
    if (extra.defined()) {
      out[0] = out[0].defined() ? at::add(out[0], extra) : std::move(extra);
    }
    return out;
  }

  // the backward without the box's entry; dy by reference: the caller's handle is its only one
  static variable_list body(AutogradContext* ctx, at::Tensor& dy, BoxSlot* slot) {
    if (!dy.defined()) {  // NOTE [Norm backward without materialized gradients]
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const bool need_x = ctx->saved_data["need_x"].toBool();
    const bool need_w = ctx->saved_data["need_w"].toBool();
    at::Tensor dx, dw;
    if (c10::GradMode::is_enabled()) {  // create_graph: the Python double, bridged to the box
      variable_list saved = saved_or_raise(ctx);
      PyGILState_STATE st = PyGILState_Ensure();
      try {
        PyObject* b = box_made(slot);
        call_python(
            g_double,
            Py_BuildValue(
                "(NNNNdOOO)",
                THPVariable_Wrap(std::move(dy)),
                THPVariable_Wrap(saved[0]),
                THPVariable_Wrap(saved[1]),
                THPVariable_Wrap(saved[2]),
                ctx->saved_data["eps"].toDouble(),
                need_x ? Py_True : Py_False,
                need_w ? Py_True : Py_False,
                b),
            dx,
            dw);
      } catch (...) {
        PyGILState_Release(st);
        throw;
      }
      PyGILState_Release(st);
      return {dx, dw, at::Tensor(), at::Tensor()};
    }
    const bool own = grant_dy(dy);
    variable_list saved = saved_or_raise(ctx);
    const at::Tensor& y = saved[0];
    if (need_x && slimgrad_watcher_mask() == 0 && !at::impl::torch_function_mode_enabled()) {
      at::Tensor g;
      if (slimgrad_rms_norm_bwd_core(
              dy,
              y,
              saved[1],
              saved[2],
              y.size(-1),
              need_w,
              own,
              ctx->saved_data["chunk"].toInt(),
              g,
              dw)) {
        return {g, dw, at::Tensor(), at::Tensor()};
      }
    }
    // _HFRMSNormFromOutputFn's tail in Python: a watcher, a body that does not apply, no dx
    PyGILState_STATE st = PyGILState_Ensure();
    try {
      call_python(
          g_fallback,
          Py_BuildValue(
              "(NNNNOOO)",
              THPVariable_Wrap(std::move(dy)),
              THPVariable_Wrap(saved[0]),
              THPVariable_Wrap(saved[1]),
              THPVariable_Wrap(saved[2]),
              own ? Py_True : Py_False,
              need_x ? Py_True : Py_False,
              need_w ? Py_True : Py_False),
          dx,
          dw);
    } catch (...) {
      PyGILState_Release(st);
      throw;
    }
    PyGILState_Release(st);
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

struct NoGil {
  PyThreadState* state;
  NoGil() : state(PyEval_SaveThread()) {}
  ~NoGil() { PyEval_RestoreThread(state); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
};

// hf_rms_norm_node(x, weight, eps, chunk_elems): y through the node, or None where the node does not cover the
// call (the caller then applies _HFRMSNormFromOutputFn). The caller passed hf_rms_norm's straight
// gate (plain float32 x requiring grad or a weight that does, nothing watching) and decided the
// module facts: the "llama" variant, a float32 weight without fallback channels, the PyTorch
// backward. Here: x and the weight exactly torch.Tensor or torch.nn.Parameter (THPVariable_
// CheckExact: no subclass), float32, the weight of shape (D,) on x's device, no functorch or
// functional wrapper, no forward-mode tangent, no saved-tensor hooks (checkpointing, offloading:
// the Python Function, whose packed tensors slimgrad.memory's walk reads), and a one-chunk
// backward (rms_norm_bwd_torch's rows per chunk cover every row).
PyObject* hf_rms_norm_node(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *px = nullptr, *pw = nullptr;
  double eps = 0.0;
  long long chunk = 0;
  if (!PyArg_ParseTuple(args, "OOdL", &px, &pw, &eps, &chunk)) {
    return nullptr;
  }
  if (g_fallback == nullptr || !THPVariable_CheckExact(px) || !THPVariable_CheckExact(pw)) {
    Py_RETURN_NONE;
  }
  const at::Tensor& x = THPVariable_Unpack(px);
  const at::Tensor& w = THPVariable_Unpack(pw);
  if (!x.defined() || !w.defined() || x.scalar_type() != at::kFloat ||
      w.scalar_type() != at::kFloat || x.dim() < 1 || w.dim() != 1 ||
      w.size(0) != x.size(-1) || x.device() != w.device() || x.layout() != c10::kStrided ||
      w.layout() != c10::kStrided || !plain_keys(x) || !plain_keys(w) ||
      x._fw_grad(0).defined() || w._fw_grad(0).defined() ||
      !at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) {
    Py_RETURN_NONE;
  }
  const int64_t numel = x.numel();
  const int64_t d = x.size(-1);
  if (numel == 0 || d == 0) {
    Py_RETURN_NONE;
  }
  const int64_t n = numel / d;
  int64_t step = numel / 16;  // rms_norm_bwd_torch's row step (backward.cpp's check)
  if (step < chunk) {
    step = chunk;
  }
  step /= d;
  if (step < 1) {
    step = 1;
  }
  if (step < n) {
    Py_RETURN_NONE;
  }
  at::Tensor y;
  {
    NoGil nogil;
    y = HFRMSNormNode::apply(x, w, eps, static_cast<int64_t>(chunk));
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

// set_norm_fallbacks(fallback, double, written, box_type): the Python tails and the box class,
// once at load.
PyObject* set_norm_fallbacks(PyObject* /*self*/, PyObject* args) {
  PyObject *f = nullptr, *d = nullptr, *w = nullptr, *b = nullptr;
  if (!PyArg_ParseTuple(args, "OOOO", &f, &d, &w, &b)) {
    return nullptr;
  }
  Py_INCREF(f);
  Py_INCREF(d);
  Py_INCREF(w);
  Py_INCREF(b);
  Py_XSETREF(g_fallback, f);
  Py_XSETREF(g_double, d);
  Py_XSETREF(g_written, w);
  Py_XSETREF(g_box_type, b);
  Py_RETURN_NONE;
}

// set_norm_grants(allowed): whether the node may grant at all (ownership.py's facts loaded and
// its interpreter shown); reads a fresh tensor's storage counts once.
PyObject* set_norm_grants(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  const int on = PyObject_IsTrue(arg);
  if (on < 0) {
    return nullptr;
  }
  if (on && g_fresh_storage_use < 0) {
    at::Tensor probe = at::empty({1});
    const c10::Storage& s = probe.storage();
    g_fresh_storage_use = static_cast<int64_t>(s.use_count());
    g_fresh_storage_weak = static_cast<int64_t>(s.getWeakStorageImpl().weak_use_count()) - 1;
  }
  g_grants_allowed.store(on);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// set_reuse_off(depth): ownership.reuse_disabled's depth (0: reuse on).
PyObject* set_reuse_off(PyObject* /*self*/, PyObject* arg) {
  const long v = PyLong_AsLong(arg);
  if (v == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  g_reuse_off.store(v != 0 ? 1 : 0);
  Py_RETURN_NONE;
}

// node_saved(node): the node's saved tensors (y, rstd, weight) for slimgrad.memory's graph walk
// (NOTE [How saved bytes are counted]), () once freed, None for any other node. The node is never
// made under saved-tensor hooks, so nothing is unpacked through a hook.
PyObject* node_saved(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  if (!torch::autograd::THPCppFunction_Check(arg)) {
    Py_RETURN_NONE;
  }
  auto* cpp = reinterpret_cast<torch::autograd::THPCppFunction*>(arg);
  auto* node = dynamic_cast<torch::autograd::CppNode<HFRMSNormNode>*>(cpp->cdata.get());
  if (node == nullptr) {
    Py_RETURN_NONE;
  }
  variable_list saved;
  try {
    saved = node->ctx_.get_saved_variables();
  } catch (const c10::Error&) {  // freed by a backward
    return PyTuple_New(0);
  }
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(saved.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < saved.size(); ++i) {
    PyObject* t = THPVariable_Wrap(saved[i]);
    if (t == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), t);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

// node_grants(reset=False): the node's grants since the last reset.
PyObject* node_grants(PyObject* /*self*/, PyObject* args) {
  int reset = 0;
  if (!PyArg_ParseTuple(args, "|p", &reset)) {
    return nullptr;
  }
  const long long n = reset ? g_grants.exchange(0) : g_grants.load();
  return PyLong_FromLongLong(n);
}

}  // namespace

// Added to the extension's module by storage_facts.cpp's init.
PyMethodDef slimgrad_norm_node_methods[] = {
    {"hf_rms_norm_node", hf_rms_norm_node, METH_VARARGS,
     "The HF Llama RMSNorm through the C++ node, else None."},
    {"set_norm_fallbacks", set_norm_fallbacks, METH_VARARGS,
     "The node's Python tails."},
    {"set_norm_grants", set_norm_grants, METH_O, "Whether the node may grant dy's buffer."},
    {"set_reuse_off", set_reuse_off, METH_O, "ownership.reuse_disabled's depth."},
    {"node_grants", node_grants, METH_VARARGS, "The node's grants (reset=True: and reset)."},
    {"node_saved", node_saved, METH_O, "The node's saved tensors (slimgrad.memory's walk)."},
    {nullptr, nullptr, 0, nullptr}};
