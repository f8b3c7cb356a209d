// viewOf(torch::nn::Module&): a LibTorch module as a ModelView.
#include <gradagg/model.h>

#include <torch/nn/module.h>

namespace gradagg {

ModelView viewOf(torch::nn::Module& module) {
  ModelView view;
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    view.parameters.push_back({item.key(), item.value()});
  for (const auto& item : module.named_buffers(/*recurse=*/true))
    view.buffers.push_back({item.key(), item.value()});
  torch::nn::Module* m = &module;
  view.current_parameters = [m] { return m->parameters(/*recurse=*/true); };
  view.is_training = [m] { return m->is_training(); };
  view.set_training = [m](bool on) { m->train(on); };
  return view;
}

}  // namespace gradagg
