// A TorchScript module (torch::jit::load, or defined in C++) as an Aggregator's
// model. Header-only: only programs that include it pay for <torch/script.h>.
#pragma once

#include <torch/script.h>

#include <gradagg/model.h>

namespace gradagg {

// The module's named parameters and buffers (recursive) and its train/eval
// switch. torch::jit::Module is a handle: the view shares the module.
inline ModelView viewOf(const torch::jit::Module& module) {
  ModelView view;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    view.parameters.push_back({p.name, p.value});
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    view.buffers.push_back({b.name, b.value});
  view.current_parameters = [module] {
    std::vector<at::Tensor> list;
    for (const auto& p : module.parameters(/*recurse=*/true)) list.push_back(p);
    return list;
  };
  view.is_training = [module] { return module.is_training(); };
  view.set_training = [m = torch::jit::Module(module)](bool on) mutable { m.train(on); };
  return view;
}

}  // namespace gradagg
