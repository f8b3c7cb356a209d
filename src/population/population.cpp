// The parent's side of population mode: map the segment, fork the members,
// drive generations (kTrain, kExploit, kPublish; each wait is a barrier with the step
// deadline and a liveness check every 50 ms), append lineage lines, read any
// member's snapshot, checkpoint and resume (population/checkpoint.cpp). The
// protocol is in population/layout.h.
//
// Lineage: members record each copy in their control block; the parent, after
// the kExploit barrier, appends one JSON line per copy (in rank order, one
// write() per line on an O_APPEND descriptor), so the file's order is the same
// in every run.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/os.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <nlohmann/json.hpp>

#include <gradagg/checkpoint.h>
#include <gradagg/options.h>

#include "checkpoint/durable_file.h"
#include "population/checkpoint.h"
#include "population/member.h"
#include "runtime/blas_warning.h"
#include "runtime/check.h"
#include "runtime/control.h"
#include "runtime/process.h"
#include "runtime/segment.h"
#include "runtime/timeouts.h"

namespace gradagg {
namespace detail::pop {

void hpToArray(const Hyperparams& hp, const std::vector<std::string>& names, double* out) {
  for (std::size_t k = 0; k < names.size(); ++k) out[k] = hp.at(names[k]);
}

Hyperparams hpFromArray(const double* values, const std::vector<std::string>& names) {
  Hyperparams hp;
  for (std::size_t k = 0; k < names.size(); ++k) hp[names[k]] = values[k];
  return hp;
}

void writeTensors(const ModelBinding& b, const PopLayout& l, std::byte* payload) {
  at::NoGradGuard no_grad;
  for (const auto& e : b.params()) viewAt(e, payload).copy_(e.tensor);
  for (const auto& e : b.buffers()) viewAt(e, l.buffersIn(payload)).copy_(e.tensor);
}

void loadTensors(const ModelBinding& b, const PopLayout& l, std::byte* payload) {
  at::NoGradGuard no_grad;
  for (const auto& e : b.params()) e.tensor.copy_(viewAt(e, payload));
  for (const auto& e : b.buffers()) e.tensor.copy_(viewAt(e, l.buffersIn(payload)));
}

}  // namespace detail::pop

using namespace detail;
using namespace detail::pop;

struct Population::Impl {
  torch::nn::Module placeholder;  // what make_optimizer gets for a ModelView
  torch::nn::Module* model;
  PopulationFns fns;
  PopulationOptions options;
  std::unique_ptr<ModelBinding> binding;
  std::vector<std::string> hp_names;
  std::vector<Hyperparams> initial_hp;
  PopLayout layout;
  Segment segment;
  ProcessSet processes;  // member r is child r
  ParentChannel channel;
  bool restart_allowed = false;  // not at start-up
  int restarts = 0;
  std::vector<MemberSetup> setups;
  int lineage_fd = -1;
  std::int64_t generation = 0;

  PopHeader& header() const { return *reinterpret_cast<PopHeader*>(segment.base()); }
  MemberArea area(int r) const { return memberArea(segment.base(), layout, r); }

  Impl(torch::nn::Module* m, const ModelView& view, PopulationFns f, PopulationOptions o)
      : model(m != nullptr ? m : &placeholder), fns(std::move(f)), options(std::move(o)) {
    options.validate();
    options.step_timeout = detail::saturated(options.step_timeout);
    options.shutdown_timeout = detail::saturated(options.shutdown_timeout);
    if (!fns.make_optimizer || !fns.hyperparams || !fns.train_step || !fns.score)
      throw InvalidArgument(
          "PopulationFns: make_optimizer, hyperparams, train_step and score "
          "are required");
    binding =
        std::make_unique<ModelBinding>(view);  // lists tensors; never adopt(): weights stay private
    drawHyperparams();
    mapSegment();
    if (!options.lineage_path.empty()) openLineage();
    detail::warnIfReferenceBlas();
    startMembers();
  }

  // Every member's initial hyperparameters, from (seed, rank); the same names for all.
  void drawHyperparams() {
    for (int r = 0; r < options.workers; ++r) {
      DecisionRng rng = DecisionRng::derive(options.seed, r, -1, kStreamHyperparams);
      initial_hp.push_back(fns.hyperparams(r, rng));
      std::vector<std::string> names;
      for (const auto& [name, v] : initial_hp.back()) names.push_back(name);
      if (r == 0) hp_names = names;
      if (names != hp_names)
        throw InvalidArgument(
            fmt::format("PopulationFns::hyperparams: rank {} has other names than rank 0", r));
    }
    if (hp_names.size() > static_cast<std::size_t>(PopulationOptions::kMaxHyperparams))
      throw InvalidArgument(fmt::format("PopulationFns::hyperparams: {} names, at most {}",
                                        hp_names.size(), PopulationOptions::kMaxHyperparams));
  }

  // The segment and its header; a resume writes each member's checkpointed
  // state as its latest snapshot.
  void mapSegment() {
    PopSizes sizes;
    sizes.workers = static_cast<std::uint32_t>(options.workers);
    sizes.hp_count = static_cast<std::uint32_t>(hp_names.size());
    for (const auto& e : binding->params())
      sizes.param_bytes = std::max(sizes.param_bytes, e.offset + alignUp(e.bytes, kAlign));
    for (const auto& e : binding->buffers())
      sizes.buffer_bytes = std::max(sizes.buffer_bytes, e.offset + alignUp(e.bytes, kAlign));
    sizes.optimizer_bytes = options.optimizer_state_bytes;
    layout = PopLayout::plan(sizes, pageBytes());
    segment = Segment::createAnonymous(layout.segment_bytes);
    PopHeader& h = header();
    h.magic = kPopMagic;
    h.layout_version = kPopLayoutVersion;
    h.layout = layout;
    if (options.resume_from.empty()) return;
    loadMembers(options.resume_from, options.workers, hp_names, *binding, layout,
                [this](int r) { return area(r); });
    h.resumed = 1;
  }

  void openLineage() {
    lineage_fd =
        ::open(options.lineage_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (lineage_fd < 0)
      throw FileError(fmt::format("gradagg: cannot open the lineage file {}: {}",
                                  options.lineage_path, std::strerror(errno)),
                      options.lineage_path);
  }

  // Forks every member and waits until each has published its first snapshot.
  void startMembers() {
    const int n = options.workers;
    const int threads = options.threads_per_worker > 0 ? options.threads_per_worker
                                                       : std::max(1, availableCores() / n);
    setups.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r)
      setups.push_back(MemberSetup{r, segment.base(), layout, binding.get(), model, &fns, &options,
                                   &hp_names, initial_hp[static_cast<std::size_t>(r)], 0,
                                   ::getpid(), threads});
    std::vector<WorkerWords> words;
    words.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r)
      words.push_back({&area(r).control->phase, &area(r).control->done_seq});
    channel = ParentChannel(header().command_seq, std::move(words), processes,
                            ChannelNames{"population member", "members", std::nullopt});
    channel.onDeath([this](int r, const ProcessExit&) {
      if (!restart_allowed || restarts >= options.max_restarts) return false;
      restart(r);
      return true;
    });
    channel.prepareStart({{&header().remaining}});
    for (int r = 0; r < n; ++r) {
      setups[r].start_seq = channel.seq();
      area(r).control->pid = processes.spawn([&s = setups[r]] { return runMember(s); });
    }
    await(Awaited{});
    channel.started();
    restart_allowed = true;
  }

  // Member r died during the current command: fork a replacement that starts
  // from r's latest complete snapshot (it loses the steps since), and that
  // arrives for this command unless r already had.
  void restart(int r) {
    ++restarts;
    MemberControl& c = *area(r).control;
    c.restart = static_cast<std::uint32_t>(channel.done(r) ? Restart::kArrivedAlready
                                                           : Restart::kOwesArrival);
    c.status = static_cast<std::uint32_t>(Status::kOk);
    c.copied = 0;
    setups[r].start_seq = channel.seq();
    channel.prepareRestart(r);
    c.pid =
        processes.respawn(static_cast<std::size_t>(r), [&s = setups[r]] { return runMember(s); });
  }

  ~Impl() {
    shutdown();
    if (lineage_fd >= 0) ::close(lineage_fd);
  }

  void shutdown() noexcept {
    channel.shutdown([this] { command(pop::Command::kStop); }, options.shutdown_timeout);
  }

  void command(pop::Command c) {
    PopHeader& h = header();
    h.command = static_cast<std::uint32_t>(c);
    h.generation = generation;
    channel.command({{&h.remaining}});
  }

  // The barrier: every member arrived (the channel raises a death or a missed
  // deadline); then the first member's failure.
  void await(const Awaited& what) {
    channel.await(header().remaining, options.step_timeout, what);
    for (int r = 0; r < options.workers; ++r) {
      const MemberControl& c = *area(r).control;
      if (c.status == static_cast<std::uint32_t>(Status::kOk)) continue;
      const std::string message(c.message, ::strnlen(c.message, sizeof(c.message)));
      channel.fail<WorkerFailed>(r,
                                 fmt::format("gradagg: population member {} failed during {}: {}",
                                             r, what.describe(), message),
                                 message);
    }
  }

  std::vector<CopyEvent> generation_() {
    if (!channel.usable())
      throw NotUsable("gradagg: the population is not usable: " + channel.unusableReason());
    command(pop::Command::kTrain);
    await(Awaited{"generation", generation, "training, publishing"});
    command(pop::Command::kExploit);
    await(Awaited{"generation", generation, "exploit, explore"});
    command(pop::Command::kPublish);
    await(Awaited{"generation", generation, "publishing copies"});
    ++generation;
    std::vector<CopyEvent> events;
    for (int r = 0; r < options.workers; ++r) {
      const MemberControl& c = *area(r).control;
      if (c.copied == 0) continue;
      CopyEvent e{c.copy_step,
                  r,
                  c.donor,
                  c.donor_version,
                  c.own_score,
                  c.donor_score,
                  hpFromArray(c.hp_before, hp_names),
                  hpFromArray(c.hp_after, hp_names)};
      if (lineage_fd >= 0) writeLineage(e);
      events.push_back(std::move(e));
    }
    return events;
  }

  void writeLineage(const CopyEvent& e) {
    nlohmann::json j = {{"step", e.step},
                        {"worker", e.worker},
                        {"donor", e.donor},
                        {"donor_version", e.donor_version},
                        {"score", e.score},
                        {"donor_score", e.donor_score},
                        {"hyperparams_before", e.before},
                        {"hyperparams_after", e.after}};
    const std::string line = j.dump() + "\n";
    const ssize_t written = ::write(lineage_fd, line.data(), line.size());
    if (written != static_cast<ssize_t>(line.size()))
      throw FileError(
          fmt::format("gradagg: writing the lineage file {} failed: {}", options.lineage_path,
                      written < 0 ? std::strerror(errno) : "short write (disk full?)"),
          options.lineage_path);
  }

  MemberSnapshot snapshot(int rank) const {
    if (rank < 0 || rank >= options.workers)
      throw InvalidArgument(fmt::format("snapshot: rank {} not in [0, {})", rank, options.workers));
    std::vector<std::byte> raw(layout.payloadBytes() + kAlign);
    auto* buf =
        reinterpret_cast<std::byte*>(alignUp(reinterpret_cast<std::uintptr_t>(raw.data()), kAlign));
    MetaValues m;
    const auto used = [&](const MetaValues& v) { return usedPayload(layout, v); };
    if (!read(area(rank), &m, buf, used, options.max_read_retries))
      throw InternalError(fmt::format("gradagg: no consistent snapshot of member {}", rank));
    MemberSnapshot s{
        rank, m.version, m.step, m.last_copy_step, m.score, hpFromArray(m.hp, hp_names),
        {},   {},        {}};
    for (const auto& e : binding->params()) s.parameters.push_back(viewAt(e, buf).clone());
    for (const auto& e : binding->buffers())
      s.buffers.push_back(viewAt(e, layout.buffersIn(buf)).clone());
    const auto n = std::min<std::uint64_t>(m.optimizer_bytes, layout.sizes.optimizer_bytes);
    s.optimizer_state.assign(reinterpret_cast<const char*>(layout.optimizerIn(buf)), n);
    return s;
  }

  void checkpoint(const std::string& path) const {
    std::vector<MemberSnapshot> members;
    members.reserve(static_cast<std::size_t>(options.workers));
    for (int r = 0; r < options.workers; ++r) members.push_back(snapshot(r));
    saveMembers(path, members, hp_names);
  }
};

Population::Population(torch::nn::Module& model, PopulationFns fns, PopulationOptions options)
    : impl_(std::make_unique<Impl>(&model, viewOf(model), std::move(fns), std::move(options))) {}
// By value, as Aggregator's (the API's one convention for a view).
Population::Population(ModelView model,  // NOLINT(performance-unnecessary-value-param)
                       PopulationFns fns, PopulationOptions options)
    : impl_(std::make_unique<Impl>(nullptr, model, std::move(fns), std::move(options))) {}
Population::~Population() = default;
std::vector<CopyEvent> Population::generation() { return impl_->generation_(); }
MemberSnapshot Population::snapshot(int rank) const { return impl_->snapshot(rank); }
void Population::checkpoint(const std::string& path) const { impl_->checkpoint(path); }
void Population::shutdown() { impl_->shutdown(); }
bool Population::usable() const noexcept { return impl_->channel.usable(); }
int Population::workers() const noexcept { return impl_->options.workers; }
int Population::restarts() const noexcept { return impl_->restarts; }
std::vector<std::string> Population::hyperparamNames() const { return impl_->hp_names; }
std::vector<int> Population::workerPids() const {
  if (!impl_->channel.usable()) return {};
  return impl_->processes.pids();
}

}  // namespace gradagg
