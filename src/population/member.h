// Pieces shared by the parent (population.cpp) and the members (member.cpp).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include <gradagg/population.h>

#include "model/model_binding.h"
#include "population/layout.h"

namespace gradagg::detail::pop {

// DecisionRng streams: one per kind of draw, so adding one never shifts another.
inline constexpr std::uint64_t kStreamHyperparams = 1;
inline constexpr std::uint64_t kStreamInit = 2;
inline constexpr std::uint64_t kStreamTrain = 3;
inline constexpr std::uint64_t kStreamExploit = 4;
inline constexpr std::uint64_t kStreamScore = 103;

// Everything a member needs; all of it inherited from the parent by fork.
struct MemberSetup {
  int rank = 0;
  std::byte* base = nullptr;
  PopLayout layout;
  ModelBinding* binding = nullptr;
  torch::nn::Module* model = nullptr;
  const PopulationFns* fns = nullptr;
  const PopulationOptions* options = nullptr;
  const std::vector<std::string>* hp_names = nullptr;
  Hyperparams initial_hp;
  std::uint32_t start_seq = 0;
  pid_t parent = 0;
  int threads = 1;
};

// The member's life (in the child): set up, publish, serve commands. Returns its exit code.
int runMember(const MemberSetup& setup);

// Hyperparameters <-> the fixed-order array in SlotMeta.
void hpToArray(const Hyperparams& hp, const std::vector<std::string>& names, double* out);
Hyperparams hpFromArray(const double* values, const std::vector<std::string>& names);

// Bytes of a snapshot's payload that are in use (params, buffers, optimizer state).
inline std::uint64_t usedPayload(const PopLayout& l, const MetaValues& m) {
  return l.sizes.param_bytes + l.sizes.buffer_bytes +
         std::min<std::uint64_t>(m.optimizer_bytes, l.sizes.optimizer_bytes);
}

// Model tensors -> payload (params at 0, buffers at param_bytes), and back.
void writeTensors(const ModelBinding& b, const PopLayout& l, std::byte* payload);
void loadTensors(const ModelBinding& b, const PopLayout& l, std::byte* payload);

}  // namespace gradagg::detail::pop
