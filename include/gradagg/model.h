// ModelView: what an Aggregator binds. Any list of named parameters and buffers
// with a train/eval switch: a torch::nn::Module gives one (viewOf below), a
// TorchScript torch::jit::Module another (gradagg/script.h), a Python
// torch.nn.Module a third (the gradagg Python module).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace gradagg {

struct NamedTensor {
  std::string name;  // e.g. "fc1.weight", named in errors
  at::Tensor tensor;
};

struct ModelView {
  // Listed once, at construction: the Aggregator moves these tensors' data into
  // shared memory (each keeps its identity) and serves exactly these.
  std::vector<NamedTensor> parameters;
  std::vector<NamedTensor> buffers;
  // The model's parameter list as it is now, for Options::check_parameter_list:
  // a replaced or added parameter makes step() throw InvalidArgument instead of
  // training tensors the optimizer no longer holds. Empty: no such check.
  std::function<std::vector<at::Tensor>()> current_parameters;
  // The train/eval switch: the parent's mode is read each step and set on the
  // workers' replicas. Empty: always training.
  std::function<bool()> is_training;
  std::function<void(bool)> set_training;
};

// A torch::nn::Module's named_parameters() and named_buffers() (recursive) and
// its train/eval switch. The view refers to the module: it must outlive the view.
ModelView viewOf(torch::nn::Module& module);

}  // namespace gradagg
