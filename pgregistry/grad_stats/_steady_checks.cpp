// The kept plan's steady-state checks in one compiled pass each (pgregistry/grad_stats/_compiled.py
// builds this file and says why; _plan.py holds the same checks in Python, which these must equal).
//
// Each reads only what its Python twin reads and answers what it answers; none changes anything. A
// Python error raised by an object's __eq__ (the roles check) propagates as it would in Python.

#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <cstdint>

namespace py = pybind11;

namespace {

// Whether every dictionary of `dicts` is empty.
bool all_empty(const py::list& dicts) {
  for (const py::handle dict : dicts) {
    if (PyDict_GET_SIZE(dict.ptr()) != 0) {
      return false;
    }
  }
  return true;
}

// The entries of `kept`, a per-piece mask (a contiguous 1-dim bool or uint8 CPU tensor), one byte a
// piece; nullptr for None (every piece kept).
const uint8_t* kept_entries(const py::object& kept, Py_ssize_t* count) {
  *count = 0;
  if (kept.is_none()) {
    return nullptr;
  }
  if (!THPVariable_Check(kept.ptr())) {
    throw py::type_error("kept must be None or a tensor of one entry a piece");
  }
  const at::Tensor& mask = THPVariable_Unpack(kept.ptr());
  if (mask.dim() != 1 || (mask.scalar_type() != at::kBool && mask.scalar_type() != at::kByte) ||
      !mask.is_contiguous() || !mask.is_cpu()) {
    throw py::value_error("kept must be a contiguous 1-dim bool or uint8 CPU tensor");
  }
  *count = static_cast<Py_ssize_t>(mask.size(0));
  return static_cast<const uint8_t*>(mask.const_data_ptr());
}

// The pieces (each parameter's grad, None skipped) when every parameter's grad is the one planned:
// the same tensor (TensorImpl, one-to-one with its Python object while both live) at the planned
// address, and no grad where none was. `planned` is a contiguous int64 CPU tensor of one row a
// parameter: the grad's TensorImpl address (0 for none) and its data address. None where any
// differs, or where a parameter is not a tensor (the Python check then decides). With `kept` (a
// mask of one entry a planned piece, kept_entries), every grad is checked alike, but only the kept
// pieces are wrapped into the list, None at the others' positions (the same length: each piece at
// its position); wrapping and appending each grad was most of this pass.
py::object planned_pieces(
    const py::list& params, const at::Tensor& planned, const py::object& kept) {
  const Py_ssize_t count = PyList_GET_SIZE(params.ptr());
  if (planned.dim() != 2 || planned.size(0) != count || planned.size(1) != 2 ||
      planned.scalar_type() != at::kLong || !planned.is_contiguous() || !planned.is_cpu()) {
    throw py::value_error("planned must be a contiguous int64 CPU tensor of one row a parameter");
  }
  const int64_t* rows = planned.const_data_ptr<int64_t>();
  Py_ssize_t kept_count = 0;
  const uint8_t* keep = kept_entries(kept, &kept_count);
  PyObject* made = keep == nullptr ? PyList_New(0) : PyList_New(kept_count);
  if (made == nullptr) {
    throw py::error_already_set();
  }
  py::list pieces = py::reinterpret_steal<py::list>(made);  // a slot not yet set is NULL: freed alike
  Py_ssize_t at = 0;
  for (Py_ssize_t index = 0; index < count; ++index) {
    PyObject* param = PyList_GET_ITEM(params.ptr(), index);
    if (!THPVariable_Check(param)) {
      return py::none();
    }
    const at::Tensor& grad = THPVariable_Unpack(param).grad();
    const int64_t impl = rows[2 * index];
    if (!grad.defined()) {
      if (impl != 0) {
        return py::none();
      }
      continue;
    }
    if (reinterpret_cast<int64_t>(grad.unsafeGetTensorImpl()) != impl || !grad.has_storage() ||
        reinterpret_cast<int64_t>(grad.data_ptr()) != rows[2 * index + 1]) {
      return py::none();
    }
    if (keep == nullptr) {
      pieces.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad)));
      continue;
    }
    if (at >= kept_count) {
      throw py::value_error("kept holds fewer entries than the planned pieces");
    }
    PyObject* piece = Py_None;
    if (keep[at] != 0) {
      piece = THPVariable_Wrap(grad);
      if (piece == nullptr) {
        throw py::error_already_set();
      }
    } else {
      Py_INCREF(piece);
    }
    PyList_SET_ITEM(made, at++, piece);
  }
  if (keep != nullptr && at != kept_count) {
    throw py::value_error("kept holds more entries than the planned pieces");
  }
  return pieces;
}

// Whether every dictionary of `empty` is still empty and the values of `dicts`, in order, are the
// objects of `held` but its last, in order and in number (identity); `held`'s last item is the
// end marker of the Python check's stream (_plan._END), not compared. Every dictionary is an exact
// dict (the caller checks when it holds them): its order is its entries' order.
bool same_holders(const py::list& empty, const py::list& dicts, const py::list& held) {
  if (!all_empty(empty)) {
    return false;
  }
  const Py_ssize_t count = PyList_GET_SIZE(held.ptr()) - 1;
  Py_ssize_t at = 0;
  for (const py::handle dict : dicts) {
    Py_ssize_t position = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(dict.ptr(), &position, &key, &value)) {
      if (at >= count || value != PyList_GET_ITEM(held.ptr(), at)) {
        return false;
      }
      ++at;
    }
  }
  return at == count;
}

// Whether the parameters' attribute dictionaries hold the roles they held: those of `bare` still
// empty, those of `roleless` still without any of `keys`, and, for each block of `blocks` and each
// of `keys` in turn, the block's dictionaries giving values equal (identity, else ==) to those of
// the next list of `held` (None for a key a dictionary lacks), as _plan.Kept._role_values lays
// them out. Every dictionary is an exact dict.
bool same_roles(
    const py::list& bare,
    const py::list& roleless,
    const py::list& blocks,
    const py::tuple& keys,
    const py::list& held) {
  if (!all_empty(bare)) {
    return false;
  }
  for (const py::handle dict : roleless) {
    for (const py::handle key : keys) {
      const int found = PyDict_Contains(dict.ptr(), key.ptr());
      if (found < 0) {
        throw py::error_already_set();
      }
      if (found) {
        return false;
      }
    }
  }
  if (PyList_GET_SIZE(held.ptr()) != PyList_GET_SIZE(blocks.ptr()) * py::len(keys)) {
    return false;
  }
  Py_ssize_t list_at = 0;
  for (const py::handle block : blocks) {
    for (const py::handle key : keys) {
      PyObject* values = PyList_GET_ITEM(held.ptr(), list_at++);
      if (!PyList_Check(values) || PyList_GET_SIZE(values) != PyList_GET_SIZE(block.ptr())) {
        return false;
      }
      Py_ssize_t at = 0;
      for (const py::handle dict : block) {
        PyObject* value = PyDict_GetItemWithError(dict.ptr(), key.ptr());
        if (value == nullptr) {
          if (PyErr_Occurred()) {
            throw py::error_already_set();
          }
          value = Py_None;
        }
        PyObject* was = PyList_GET_ITEM(values, at++);
        if (value == was) {
          continue;
        }
        Py_INCREF(value);  // __eq__ may drop the dictionary's reference
        const int equal = PyObject_RichCompareBool(value, was, Py_EQ);
        Py_DECREF(value);
        if (equal < 0) {
          throw py::error_already_set();
        }
        if (!equal) {
          return false;
        }
      }
    }
  }
  return true;
}


// Whether every item of `tensors` is a plain torch.Tensor (no subclass, whose __torch_function__
// the Python reads would ask).
bool all_plain_tensors(const py::list& tensors) {
  for (const py::handle tensor : tensors) {
    if (!THPVariable_CheckExact(tensor.ptr())) {
      return false;
    }
  }
  return true;
}

// Each tensor's address, element count, dtype and (with `contiguity`) contiguity, one tensor after
// another in one flat list: _plan._piece_facts's list, read without a Python call a fact. None
// where a tensor is not a plain torch.Tensor (the Python reads then decide). A tensor without
// storage raises RuntimeError, as its data_ptr() does.
py::object piece_facts(const py::list& tensors, bool contiguity) {
  if (!all_plain_tensors(tensors)) {
    return py::none();
  }
  const Py_ssize_t width = contiguity ? 4 : 3;
  PyObject* facts = PyList_New(PyList_GET_SIZE(tensors.ptr()) * width);
  if (facts == nullptr) {
    throw py::error_already_set();
  }
  py::list owned = py::reinterpret_steal<py::list>(facts);
  Py_ssize_t at = 0;
  for (const py::handle item : tensors) {
    const at::Tensor& tensor = THPVariable_Unpack(item.ptr());
    PyList_SET_ITEM(facts, at++, PyLong_FromVoidPtr(tensor.data_ptr()));
    PyList_SET_ITEM(facts, at++, PyLong_FromLongLong(tensor.numel()));
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(tensor.scalar_type()));
    Py_INCREF(dtype);
    PyList_SET_ITEM(facts, at++, dtype);
    if (contiguity) {
      PyList_SET_ITEM(facts, at++, py::bool_(tensor.is_contiguous()).release().ptr());
    }
  }
  for (Py_ssize_t index = 0; index < at; ++index) {
    if (PyList_GET_ITEM(facts, index) == nullptr) {
      throw py::error_already_set();
    }
  }
  return owned;
}

// Python's garbage collector paused while this lives (as it was before, after).
class GarbageCollectorPaused {
 public:
  GarbageCollectorPaused() : was_enabled_(PyGC_Disable()) {}
  ~GarbageCollectorPaused() {
    if (was_enabled_) {
      PyGC_Enable();
    }
  }
  GarbageCollectorPaused(const GarbageCollectorPaused&) = delete;
  GarbageCollectorPaused& operator=(const GarbageCollectorPaused&) = delete;

 private:
  int was_enabled_;
};

// `tensor`'s shape as a torch.Size, made as torch makes one (a tuple of its type, of Python ints).
py::object shape_of(const at::Tensor& tensor) {
  const auto sizes = tensor.sizes();
  const auto dims = static_cast<Py_ssize_t>(sizes.size());
  py::object shape = py::reinterpret_steal<py::object>(THPSizeType.tp_alloc(&THPSizeType, dims));
  if (!shape) {
    throw py::error_already_set();
  }
  for (Py_ssize_t dim = 0; dim < dims; ++dim) {
    PyObject* size = PyLong_FromLongLong(sizes[dim]);
    if (size == nullptr) {
      throw py::error_already_set();
    }
    PyTuple_SET_ITEM(shape.ptr(), dim, size);
  }
  return shape;
}

// Each tensor's device and shape, one tensor after another in one flat list: _plan._KIND_READS's
// facts. None where a tensor is not a plain torch.Tensor.
py::object kind_facts(const py::list& tensors) {
  if (!all_plain_tensors(tensors)) {
    return py::none();
  }
  // Each shape is a tuple the garbage collector tracks: made 20,000 in a row, they set off
  // collections that took 20x the pass on the 2-core machine (224 against 12 ms). No cycle is made
  // here, so the collector waits until the pass ends.
  const GarbageCollectorPaused paused;
  py::list facts;
  for (const py::handle item : tensors) {
    const at::Tensor& tensor = THPVariable_Unpack(item.ptr());
    facts.append(py::reinterpret_steal<py::object>(THPDevice_New(tensor.device())));
    facts.append(shape_of(tensor));
  }
  return facts;
}

// Whether every tensor of `tensors` that `moved` flags (a list of bools, one a tensor) has the
// device and shape `held` gives for it (the flat list kind_facts made when the kinds were planned,
// a device and a torch.Size a tensor): _plan._same_kinds_where_moved's answer, read without making
// a device or a shape. None where a flagged tensor is not a plain torch.Tensor, or `held` does not
// hold a device and a torch.Size where one is due (the Python reads then decide).
py::object same_kinds_where_moved(
    const py::list& tensors, const py::list& moved, const py::list& held) {
  const Py_ssize_t count = PyList_GET_SIZE(tensors.ptr());
  if (PyList_GET_SIZE(moved.ptr()) != count || PyList_GET_SIZE(held.ptr()) != 2 * count) {
    throw py::value_error("moved takes one flag a tensor and held two facts a tensor");
  }
  for (Py_ssize_t index = 0; index < count; ++index) {
    if (PyList_GET_ITEM(moved.ptr(), index) != Py_True) {
      continue;
    }
    PyObject* item = PyList_GET_ITEM(tensors.ptr(), index);
    PyObject* device = PyList_GET_ITEM(held.ptr(), 2 * index);
    PyObject* shape = PyList_GET_ITEM(held.ptr(), 2 * index + 1);
    if (!THPVariable_CheckExact(item) || !THPDevice_Check(device) ||
        !THPSize_Check(shape)) {
      return py::none();
    }
    const at::Tensor& tensor = THPVariable_Unpack(item);
    if (reinterpret_cast<THPDevice*>(device)->device != tensor.device()) {
      return py::bool_(false);
    }
    const auto sizes = tensor.sizes();
    if (PyTuple_GET_SIZE(shape) != static_cast<Py_ssize_t>(sizes.size())) {
      return py::bool_(false);
    }
    for (size_t dim = 0; dim < sizes.size(); ++dim) {
      const long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, dim));
      if (size == -1 && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      if (size != sizes[dim]) {
        return py::bool_(false);
      }
    }
  }
  return py::bool_(true);
}

// Each grad of `grads` (None or a tensor) as one row of a contiguous int64 CPU tensor: its tensor's
// address (Tensor._cdata; 0 for None) and its data's (0 for None), for planned_pieces.
at::Tensor planned_rows(const py::list& grads) {
  const Py_ssize_t count = PyList_GET_SIZE(grads.ptr());
  at::Tensor rows = at::zeros({static_cast<int64_t>(count), 2}, at::kLong);
  int64_t* row = rows.data_ptr<int64_t>();
  for (const py::handle grad : grads) {
    if (!grad.is_none()) {
      if (!THPVariable_Check(grad.ptr())) {
        throw py::type_error("planned_rows takes tensors and None");
      }
      const at::Tensor& tensor = THPVariable_Unpack(grad.ptr());
      row[0] = reinterpret_cast<int64_t>(tensor.unsafeGetTensorImpl());
      row[1] = reinterpret_cast<int64_t>(tensor.data_ptr());
    }
    row += 2;
  }
  return rows;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def(
      "planned_pieces",
      &planned_pieces,
      py::arg("params"),
      py::arg("planned"),
      py::arg("kept") = py::none());
  module.def("piece_facts", &piece_facts, py::arg("tensors"), py::arg("contiguity"));
  module.def("kind_facts", &kind_facts, py::arg("tensors"));
  module.def("planned_rows", &planned_rows, py::arg("grads"));
  module.def(
      "same_kinds_where_moved",
      &same_kinds_where_moved,
      py::arg("tensors"),
      py::arg("moved"),
      py::arg("held"));
  module.def("same_holders", &same_holders, py::arg("empty"), py::arg("dicts"), py::arg("held"));
  module.def(
      "same_roles",
      &same_roles,
      py::arg("bare"),
      py::arg("roleless"),
      py::arg("blocks"),
      py::arg("keys"),
      py::arg("held"));
}
