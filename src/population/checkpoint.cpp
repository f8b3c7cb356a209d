#include "population/checkpoint.h"

#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/serialize/archive.h>

#include <gradagg/checkpoint.h>
#include <gradagg/errors.h>

#include "checkpoint/durable_file.h"

namespace gradagg::detail::pop {

void saveMembers(const std::string& path, const std::vector<MemberSnapshot>& members,
                 const std::vector<std::string>& hp_names) {
  torch::serialize::OutputArchive root;
  root.write("format", c10::IValue(std::string(kPopulationFormat)));
  root.write("workers", at::tensor(static_cast<std::int64_t>(members.size())));
  root.write("hp_names", c10::IValue(fmt::format("{}", fmt::join(hp_names, ","))));
  for (std::size_t r = 0; r < members.size(); ++r) {
    const MemberSnapshot& s = members[r];
    torch::serialize::OutputArchive a;
    for (std::size_t k = 0; k < s.parameters.size(); ++k)
      a.write(fmt::format("p{}", k), s.parameters[k]);
    for (std::size_t k = 0; k < s.buffers.size(); ++k)
      a.write(fmt::format("b{}", k), s.buffers[k], true);
    a.write("meta", at::tensor(std::vector<std::int64_t>{static_cast<std::int64_t>(s.version),
                                                         s.step, s.last_copy_step}));
    a.write("score", at::tensor(s.score, at::kDouble));
    std::vector<double> hp;
    hp.reserve(hp_names.size());
    for (const auto& name : hp_names) hp.push_back(s.hyperparams.at(name));
    a.write("hp", at::tensor(hp, at::kDouble).reshape({static_cast<std::int64_t>(hp.size())}));
    a.write("optimizer",
            at::from_blob(const_cast<char*>(s.optimizer_state.data()),
                          {static_cast<std::int64_t>(s.optimizer_state.size())}, at::kByte)
                .clone(),
            true);
    root.write(fmt::format("member{}", r), a);
  }
  std::string payload;
  root.save_to([&](const void* data, std::size_t n) {
    payload.append(static_cast<const char*>(data), n);
    return n;
  });
  writeDurably(path, payload);
}

namespace {
// Member r's sub-archive `a` as its latest snapshot in `area`.
void loadMember(torch::serialize::InputArchive& a, const std::string& path, int r,
                const std::vector<std::string>& hp_names, const ModelBinding& binding,
                const PopLayout& layout, const MemberArea& area) {
  at::Tensor meta, score, hp, opt;
  a.read("meta", meta);
  a.read("score", score);
  a.read("hp", hp);
  a.read("optimizer", opt, true);
  if (static_cast<std::uint64_t>(opt.numel()) > layout.sizes.optimizer_bytes)
    throw InvalidArgument(
        fmt::format("resume_from {}: member {}'s optimizer state ({} bytes) "
                    "exceeds optimizer_state_bytes",
                    path, r, opt.numel()));
  MetaValues m;
  m.version = static_cast<std::uint64_t>(meta[0].item<std::int64_t>());
  m.step = meta[1].item<std::int64_t>();
  m.last_copy_step = meta[2].item<std::int64_t>();
  m.score = score.item<double>();
  m.optimizer_bytes = static_cast<std::uint64_t>(opt.numel());
  m.hp_count = static_cast<std::uint32_t>(hp_names.size());
  for (std::size_t k = 0; k < hp_names.size(); ++k)
    m.hp[k] = hp[static_cast<std::int64_t>(k)].item<double>();
  publish(area, m,
          [&](std::byte* p) {
            at::NoGradGuard no_grad;
            for (std::size_t k = 0; k < binding.params().size(); ++k) {
              at::Tensor t;
              a.read(fmt::format("p{}", k), t);
              viewAt(binding.params()[k], p).copy_(t);
            }
            for (std::size_t k = 0; k < binding.buffers().size(); ++k) {
              at::Tensor t;
              a.read(fmt::format("b{}", k), t, true);
              viewAt(binding.buffers()[k], layout.buffersIn(p)).copy_(t);
            }
            if (opt.numel() > 0) std::memcpy(layout.optimizerIn(p), opt.data_ptr(), opt.numel());
          },
          {});
}
}  // namespace

void loadMembers(const std::string& path, int workers, const std::vector<std::string>& hp_names,
                 const ModelBinding& binding, const PopLayout& layout,
                 const std::function<MemberArea(int)>& area) {
  torch::serialize::InputArchive root;
  const std::string payload = readVerified(path);
  at::Tensor stored;
  c10::IValue names;
  try {
    root.load_from(payload.data(), payload.size());
    // Older population checkpoints have no format; a gradagg::Checkpoint has its own.
    c10::IValue format;
    if (root.try_read("format", format) &&
        !(format.isString() && format.toStringRef() == kPopulationFormat))
      throw CheckpointError(
          fmt::format("gradagg: checkpoint {}: is not a population checkpoint ({}, "
                      "Population::checkpoint): it is {}",
                      path, kPopulationFormat,
                      format.isString() && format.toStringRef() == kCheckpointFormat
                          ? fmt::format("a gradagg::Checkpoint ({})", kCheckpointFormat)
                          : "of another kind"),
          path);
    root.read("workers", stored);
    root.read("hp_names", names);
    if (!names.isString()) throw c10::Error("hp_names is not a string", "");
  } catch (const c10::Error& e) {
    // Not a population's archive (another program's checkpoint, say).
    throw CheckpointError(fmt::format("gradagg: checkpoint {}: is not a population checkpoint "
                                      "(cannot be parsed as one: {})",
                                      path, e.what_without_backtrace()),
                          path);
  }
  if (stored.item<std::int64_t>() != workers)
    throw InvalidArgument(fmt::format("resume_from {}: {} members, options say {}", path,
                                      stored.item<std::int64_t>(), workers));
  if (names.toStringRef() != fmt::format("{}", fmt::join(hp_names, ",")))
    throw InvalidArgument(fmt::format("resume_from {}: hyperparameters '{}', expected '{}'", path,
                                      names.toStringRef(), fmt::join(hp_names, ",")));
  for (int r = 0; r < workers; ++r) {
    torch::serialize::InputArchive a;
    root.read(fmt::format("member{}", r), a);
    loadMember(a, path, r, hp_names, binding, layout, area(r));
  }
}

}  // namespace gradagg::detail::pop
