// Storage facts for slimgrad.ownership, read through PyTorch's public C++ API only (NOTE [Storage
// facts from the C++ API] in slimgrad/_ext/__init__.py). ``facts(tensor)`` (and ``plain_facts``)
// return a tuple of ints about the tensor and its storage; they create no storage object and no
// tensor, and take no reference that would show in the counts they read (the tensor argument is
// borrowed). ``call_origin`` serves slimgrad.memory's tracker (below).
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/Allocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <cstdint>
#include <vector>

long slimgrad_watcher_mask();
extern PyMethodDef slimgrad_backward_methods[];       // backward.cpp
extern PyMethodDef slimgrad_gpt2_backward_methods[];  // backward.cpp, GPT-2's attention
extern PyMethodDef slimgrad_norm_node_methods[];      // norm_node.cpp

namespace {

// Whether torch's allocator for this device type made the memory: its DataPtr is freed by that
// allocator's raw deleter. from_numpy, frombuffer, from_dlpack, shared or mapped memory and pinned
// host memory carry other deleters; a null deleter is memory nobody frees here (from_blob).
int torch_owned(const c10::Storage& s) {
  c10::DeleterFnPtr deleter = s.data_ptr().get_deleter();
  if (deleter == nullptr) {
    return 0;
  }
  c10::Allocator* alloc = nullptr;
  try {
    alloc = c10::GetAllocator(s.device_type());
  } catch (const std::exception&) {
    return 0;
  }
  return (alloc != nullptr && alloc->raw_deleter() == deleter) ? 1 : 0;
}

// (tensor use count, storage use count, storage weak count, has storage object, storage nbytes,
//  torch-owned, StorageImpl address as an identity): see NOTE [Storage facts from the C++ API].
// None for a tensor without storage.
PyObject* facts(PyObject* /*self*/, PyObject* arg) {
  if (!THPVariable_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "slimgrad._ext.storage_facts.facts: expected a Tensor");
    return nullptr;
  }
  try {
    const at::Tensor& t = THPVariable_Unpack(arg);
    if (!t.defined() || !t.has_storage()) {
      Py_RETURN_NONE;
    }
    const c10::Storage& s = t.storage();
    c10::StorageImpl* impl = s.unsafeGetStorageImpl();
    if (impl == nullptr) {
      Py_RETURN_NONE;
    }
    // the weak count as seen through one more weak pointer (ours), less that one
    long long weak = static_cast<long long>(s.getWeakStorageImpl().weak_use_count()) - 1;
    int has_obj = impl->pyobj_slot()->load_pyobj() != nullptr ? 1 : 0;
    const int owned = torch_owned(s);
    return Py_BuildValue(
        "(KKLiKiK)",
        static_cast<unsigned long long>(t.use_count()),
        static_cast<unsigned long long>(s.use_count()),
        weak,
        has_obj,
        static_cast<unsigned long long>(s.nbytes()),
        owned,
        static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(impl)));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// The facts of ``facts`` for a tensor that may be written over in place, in one call (the hot path
// of slimgrad.ownership.take/take_saved/owns_input), or None where the tensor is not one:
// ``plain_facts(t, kind)`` with kind 0 (an incoming gradient: views allowed, not requiring grad),
// 1 (a saved tensor: no view; a non-leaf that requires grad allowed) or 2 (a forward input: no
// view, not a leaf that requires grad). A tensor is one when it is exactly ``torch.Tensor`` (no
// subclass), strided, not nested, no conj/neg bit, not a functorch wrapper or functional tensor,
// has elements, and covers its whole storage densely from offset 0 (``is_non_overlapping_and_dense``
// with ``numel * itemsize == storage nbytes``). Returns (tensor use count, storage use count,
// storage weak count, has storage object, torch-owned, StorageImpl address, is a view).
PyObject* plain_facts_of(PyObject* arg, int kind) {
  if (!THPVariable_CheckExact(arg)) {  // None, a subclass (Parameter, FakeTensor, DTensor, ...)
    Py_RETURN_NONE;
  }
  try {
    const at::Tensor& t = THPVariable_Unpack(arg);
    if (!t.defined() || !t.has_storage() || t.layout() != c10::kStrided || t.is_nested() ||
        t.is_conj() || t.is_neg() || t.numel() == 0 || t.storage_offset() != 0) {
      Py_RETURN_NONE;
    }
    const c10::DispatchKeySet ks = t.key_set();
    if (ks.has(c10::DispatchKey::FuncTorchGradWrapper) ||
        ks.has(c10::DispatchKey::FuncTorchBatched) || ks.has(c10::DispatchKey::Functionalize) ||
        ks.has(c10::DispatchKey::Python)) {
      Py_RETURN_NONE;
    }
    const bool view = t.is_view();
    const bool rg = t.requires_grad();
    if ((kind == 0 && rg) || (kind != 0 && view) || (kind != 0 && rg && t.is_leaf())) {
      Py_RETURN_NONE;
    }
    const c10::Storage& s = t.storage();
    c10::StorageImpl* impl = s.unsafeGetStorageImpl();
    if (impl == nullptr ||
        static_cast<size_t>(t.numel()) * t.element_size() != s.nbytes() ||
        !t.unsafeGetTensorImpl()->is_non_overlapping_and_dense()) {
      Py_RETURN_NONE;
    }
    long long weak = static_cast<long long>(s.getWeakStorageImpl().weak_use_count()) - 1;
    int has_obj = impl->pyobj_slot()->load_pyobj() != nullptr ? 1 : 0;
    const int owned = torch_owned(s);
    return Py_BuildValue(
        "(KKLiiKi)",
        static_cast<unsigned long long>(t.use_count()),
        static_cast<unsigned long long>(s.use_count()),
        weak,
        has_obj,
        owned,
        static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(impl)),
        view ? 1 : 0);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* plain_facts(PyObject* /*self*/, PyObject* args) {
  PyObject* arg = nullptr;
  int kind = 0;
  if (!PyArg_ParseTuple(args, "Oi", &arg, &kind)) {
    return nullptr;
  }
  return plain_facts_of(arg, kind);
}

// torch._C._are_functorch_transforms_active(): a functorch transform's layer keys are in the
// thread's included dispatch keys.
bool functorch_active() {
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

}  // namespace

// Who watches eager PyTorch right now, as a bit mask (0: nobody), each bit the C++ fact that
// torch's own Python binding returns (NOTE [One-call gate] in slimgrad/_library.py):
// 1 torch._C._len_torch_dispatch_stack() > 0, 2 torch._C._is_torch_function_mode_enabled(),
// 4 torch._C._are_functorch_transforms_active(), 8 torch._C._is_tracing(),
// 16 torch._C._autograd._profiler_enabled(). Also read by backward.cpp.
long slimgrad_watcher_mask() {
  long mask = 0;
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    mask |= 1;
  }
  if (at::impl::torch_function_mode_enabled()) {
    mask |= 2;
  }
  if (functorch_active()) {
    mask |= 4;
  }
  if (torch::jit::tracer::isTracing()) {
    mask |= 8;
  }
  if (torch::profiler::impl::profilerEnabled()) {
    mask |= 16;
  }
  return mask;
}

namespace {

// ``watchers()``: slimgrad_watcher_mask() for slimgrad._library.straight.
PyObject* watchers(PyObject* /*self*/, PyObject* /*unused*/) {
  long mask = 0;
  try {
    mask = slimgrad_watcher_mask();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyLong_FromLong(mask);
}

// Whether ``obj`` has a Python weak reference (``_weakref.getweakrefcount(obj) != 0``, what
// weakref's is): 1 yes, 0 no, -1 with a Python error set.
int has_weakrefs(PyObject* obj) {
  static PyObject* weakcount = nullptr;  // _weakref.getweakrefcount
  if (weakcount == nullptr) {
    PyObject* mod = PyImport_ImportModule("_weakref");
    if (mod == nullptr) {
      return -1;
    }
    weakcount = PyObject_GetAttrString(mod, "getweakrefcount");
    Py_DECREF(mod);
    if (weakcount == nullptr) {
      return -1;
    }
  }
  PyObject* n = PyObject_CallOneArg(weakcount, obj);
  if (n == nullptr) {
    return -1;
  }
  const int truth = PyObject_IsTrue(n);
  Py_DECREF(n);
  return truth;
}

// ``plain_facts(t, kind)`` for a backward's question (kind 0: an incoming gradient, 1: a saved
// tensor), or None where a per-call term of NOTE [Gradient-buffer ownership] refuses first:
// grad mode on (torch.is_grad_enabled()), not inside the autograd engine
// (torch._C._current_graph_task_id() == -1), a functorch transform active, for kind 0 a Python
// weak reference to ``t`` (weakref.getweakrefcount), for kind 1 the graph kept
// (torch._C._autograd._get_current_graph_task_keep_graph()). One call for what
// slimgrad.ownership asked in six.
PyObject* backward_facts(PyObject* /*self*/, PyObject* args) {
  PyObject* arg = nullptr;
  int kind = 0;
  if (!PyArg_ParseTuple(args, "Oi", &arg, &kind)) {
    return nullptr;
  }
  try {
    if (c10::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() == -1 ||
        functorch_active() ||
        (kind != 0 && torch::autograd::get_current_graph_task_keep_graph())) {
      Py_RETURN_NONE;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  if (kind == 0) {
    const int weak = has_weakrefs(arg);
    if (weak != 0) {
      if (weak < 0) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
  }
  return plain_facts_of(arg, kind);
}

// ``view_base(t)``: for a gradient ``t`` that is a view (backward_facts' last fact), the
// (refcount, use count) of its base that slimgrad.ownership compares with the calibrated pair
// (term 2b of NOTE [Gradient-buffer ownership]), or None where the base is not a plain strided
// ``torch.Tensor`` without autograd state sharing ``t``'s StorageImpl: the questions
// ``ownership._view_sig`` asks in Python, in one call. As there, the base's Python object is made
// first (what ``t._base`` does: THPVariable_Wrap; PyTorch keeps it with the base, it holds no
// use of it), then: exactly ``torch.Tensor``; not a view; not ``requires_grad``, no ``.grad``,
// no ``grad_fn``; strided, not nested, on ``t``'s device; no Python weak reference; not a
// functorch wrapper (``torch._C._functorch.is_functorch_wrapped_tensor``: a grad wrapper or a
// batched tensor); has storage, the same StorageImpl as ``t``. The refcount is the base object's
// while this call holds the one reference it took (ownership calibrates it with this function).
PyObject* view_base(PyObject* /*self*/, PyObject* arg) {
  if (!THPVariable_CheckExact(arg)) {
    Py_RETURN_NONE;
  }
  PyObject* obj = nullptr;
  try {
    const at::Tensor& t = THPVariable_Unpack(arg);
    if (!t.defined() || !t.is_view()) {
      Py_RETURN_NONE;
    }
    const at::TensorBase& base = t._base();
    obj = THPVariable_Wrap(base);  // new reference
    if (obj == nullptr) {
      return nullptr;
    }
    bool ok = THPVariable_CheckExact(obj) && !base.is_view() && !base.requires_grad() &&
        !base.unsafeGetTensorImpl()->grad().defined() && base.grad_fn() == nullptr &&
        base.layout() == c10::kStrided && !base.is_nested() && base.device() == t.device();
    if (ok) {
      const int weak = has_weakrefs(obj);
      if (weak < 0) {
        Py_DECREF(obj);
        return nullptr;
      }
      ok = weak == 0;
    }
    if (ok) {
      const c10::DispatchKeySet ks = base.key_set();
      ok = !ks.has(c10::DispatchKey::FuncTorchGradWrapper) &&
          !ks.has(c10::DispatchKey::FuncTorchBatched) && base.has_storage() &&
          t.has_storage() &&
          base.storage().unsafeGetStorageImpl() == t.storage().unsafeGetStorageImpl() &&
          base.storage().unsafeGetStorageImpl() != nullptr;
    }
    if (!ok) {
      Py_DECREF(obj);
      Py_RETURN_NONE;
    }
    PyObject* out = Py_BuildValue(
        "(nK)", Py_REFCNT(obj), static_cast<unsigned long long>(base.use_count()));
    Py_DECREF(obj);
    return out;
  } catch (const std::exception& e) {
    Py_XDECREF(obj);
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// One parameter's part of ``norm_key`` (a new reference, nullptr with a Python error set): None,
// or a tuple of its version, data pointer, dtype, device type and index, dimension count, sizes and
// strides.
PyObject* param_key(PyObject* arg) {
  if (arg == Py_None) {
    Py_RETURN_NONE;
  }
  const at::Tensor& t = THPVariable_Unpack(arg);
  std::vector<long long> v;
  v.reserve(6 + 2 * static_cast<size_t>(t.dim()));
  v.push_back(static_cast<long long>(t._version()));  // raises for an inference tensor
  v.push_back(static_cast<long long>(reinterpret_cast<intptr_t>(t.const_data_ptr())));
  v.push_back(static_cast<long long>(t.scalar_type()));
  v.push_back(static_cast<long long>(t.device().type()));
  v.push_back(static_cast<long long>(t.device().index()));
  v.push_back(static_cast<long long>(t.dim()));
  for (const auto s : t.sizes()) {
    v.push_back(static_cast<long long>(s));
  }
  for (const auto s : t.strides()) {
    v.push_back(static_cast<long long>(s));
  }
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < v.size(); ++i) {
    PyObject* n = PyLong_FromLongLong(v[i]);
    if (n == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), n);  // steals n
  }
  return out;
}

// ``norm_key(weight, bias)``: what slimgrad._math.norms keys its fallback channels by (NOTE
// [Fallback channels, once per weight version] there), in one call: ``(weight part, bias part)``,
// each None (for None) or a tuple of the tensor's ``_version``, ``data_ptr()``, dtype, device,
// dimension count, ``shape`` and ``stride()`` as ints, so two keys are equal iff every one of those
// facts is (the first int is the version, as in the Python key). A RuntimeError where torch's own
// accessor raises (an inference tensor's ``_version``), as in Python.
PyObject* norm_key(PyObject* /*self*/, PyObject* args) {
  PyObject* w = nullptr;
  PyObject* b = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &w, &b)) {
    return nullptr;
  }
  if ((w != Py_None && !THPVariable_Check(w)) || (b != Py_None && !THPVariable_Check(b))) {
    PyErr_SetString(PyExc_TypeError, "slimgrad._ext.storage_facts.norm_key: expected Tensors");
    return nullptr;
  }
  PyObject* wk = nullptr;
  PyObject* bk = nullptr;
  try {
    wk = param_key(w);
    if (wk == nullptr) {
      return nullptr;
    }
    bk = param_key(b);
    if (bk == nullptr) {
      Py_DECREF(wk);
      return nullptr;
    }
  } catch (const std::exception& e) {
    Py_XDECREF(wk);
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(2, wk, bk);
  Py_DECREF(wk);
  Py_DECREF(bk);
  return out;
}

// Who called the op slimgrad.memory's tracker is counting (NOTE [How live bytes are counted] in
// slimgrad/memory.py): 1 ("engine") when the nearest Python frame below the caller of this function
// (``__torch_dispatch__``), past frames whose file is in ``skip`` (dynamo's wrappers), runs
// ``engine`` (the engine's entry: the op was called by C++ code the engine runs), 2 ("function")
// when a frame running ``py_backward`` (a custom Function's backward) comes before the engine's
// entry, 0 ("python") otherwise. Read with CPython's public frame API (PyEval_GetFrame,
// PyFrame_GetBack, PyFrame_GetCode); only the tracker calls it, never slimgrad's per-call path.
PyObject* call_origin(PyObject* /*self*/, PyObject* args) {
  PyObject* engine = nullptr;
  PyObject* py_backward = nullptr;
  PyObject* skip = nullptr;
  if (!PyArg_ParseTuple(args, "OOO!", &engine, &py_backward, &PyFrozenSet_Type, &skip)) {
    return nullptr;
  }
  PyFrameObject* top = PyEval_GetFrame();  // borrowed: the frame that called this function
  PyFrameObject* f = top == nullptr ? nullptr : PyFrame_GetBack(top);  // new reference
  while (f != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(f);
    PyObject* file = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_filename");
    Py_DECREF(code);
    const int in = file == nullptr ? -1 : PySet_Contains(skip, file);
    Py_XDECREF(file);
    if (in < 0) {
      Py_DECREF(f);
      return nullptr;
    }
    if (in == 0) {
      break;
    }
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  long origin = 0;
  bool first = true;
  while (f != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(f);
    const bool is_engine = reinterpret_cast<PyObject*>(code) == engine;
    const bool is_backward = reinterpret_cast<PyObject*>(code) == py_backward;
    Py_DECREF(code);
    if (is_engine) {
      origin = first ? 1 : 0;
      break;
    }
    if (is_backward) {
      origin = 2;
      break;
    }
    first = false;
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  return PyLong_FromLong(origin);
}

// The node a CopySlices node wraps (NOTE [How saved bytes are counted] in slimgrad/memory.py): the
// in-place op's own node (``CopySlices::fn``, torch/csrc/autograd/functions/tensor.h), whose saved
// tensors autograd keeps and for which torch binds no accessor; None for any other object. Only the
// tracker's graph walk calls it.
PyObject* copy_slices_fn(PyObject* /*self*/, PyObject* arg) {
  if (!torch::autograd::THPCppFunction_Check(arg)) {
    Py_RETURN_NONE;
  }
  try {
    auto* cpp = reinterpret_cast<torch::autograd::THPCppFunction*>(arg);
    auto* slices = dynamic_cast<torch::autograd::CopySlices*>(cpp->cdata.get());
    if (slices == nullptr || !slices->fn) {
      Py_RETURN_NONE;
    }
    return torch::autograd::functionToPyObject(slices->fn);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"facts", facts, METH_O, "Storage facts of a tensor (slimgrad.ownership)."},
    {"plain_facts", plain_facts, METH_VARARGS,
     "Storage facts of a plain dense tensor, else None (slimgrad.ownership)."},
    {"watchers", watchers, METH_NOARGS,
     "Who watches eager PyTorch: a bit mask, 0 for nobody (slimgrad._library.straight)."},
    {"backward_facts", backward_facts, METH_VARARGS,
     "plain_facts behind a backward's per-call terms, else None (slimgrad.ownership)."},
    {"view_base", view_base, METH_O,
     "(refcount, use count) of a view gradient's plain base, else None (slimgrad.ownership)."},
    {"norm_key", norm_key, METH_VARARGS,
     "The fallback channels' key of a norm's weight and bias (slimgrad._math.norms)."},
    {"call_origin", call_origin, METH_VARARGS,
     "Who called the op being counted: 0 Python, 1 the engine, 2 a Function's backward "
     "(slimgrad.memory)."},
    {"copy_slices_fn", copy_slices_fn, METH_O,
     "The node a CopySlices node wraps, else None (slimgrad.memory)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, C10_STRINGIZE(TORCH_EXTENSION_NAME), nullptr, -1, methods};

}  // namespace

// For norm_node.cpp (NOTE [dy's ownership asked by the C++ node]): term 7 and the weak-reference
// question, as this file asks them.
int slimgrad_torch_owned(const c10::Storage& s) {
  return torch_owned(s);
}

int slimgrad_has_weakrefs(PyObject* obj) {
  return has_weakrefs(obj);
}


#define SLIMGRAD_CONCAT_(a, b) a##b
#define SLIMGRAD_CONCAT(a, b) SLIMGRAD_CONCAT_(a, b)

PyMODINIT_FUNC SLIMGRAD_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* mod = PyModule_Create(&module_def);
  if (mod != nullptr && (PyModule_AddFunctions(mod, slimgrad_backward_methods) < 0 ||
                         PyModule_AddFunctions(mod, slimgrad_gpt2_backward_methods) < 0 ||
                         PyModule_AddFunctions(mod, slimgrad_norm_node_methods) < 0)) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
