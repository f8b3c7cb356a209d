// A member's life, in its forked child: its replica is its own copy of the
// model; its parameters stay private (never adopted into the segment).
//
// Start: set the thread count, then either resume (load its latest slot, which
// the parent wrote from the checkpoint, or which it published itself before it
// died and was restarted) or init its weights; create its
// optimizer; score; publish version 1 (or the resumed version + 1); arrive.
// Then serve the parent's commands (the serve loop, runtime/serve.h; the
// protocol in population/layout.h):
//   kTrain:   publish_interval train steps, score, publish, arrive;
//   kExploit: read every member's score, let the policy decide with the
//             (seed, rank, step) generator; on a copy: read the donor's latest
//             snapshot, load its weights (and optimizer state, hyperparameters
//             as the options say), explore, apply the hyperparameters to the
//             optimizer AFTER loading the state, record the copy in the
//             control block; arrive (nobody publishes while others read);
//   kPublish: a member that copied publishes; arrive.
// Any exception becomes a failed status with its message; the member then
// serves nothing more and waits for the parent to stop it.
#include <unistd.h>

#include <cstring>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <gradagg/blas.h>

#include "population/member.h"
#include "runtime/control.h"
#include "runtime/heap.h"
#include "runtime/serve.h"
#include "runtime/test_seam.h"

namespace gradagg::detail::pop {

namespace {

void defaultApply(torch::optim::Optimizer& opt, const Hyperparams& hp) {
  const auto lr = hp.find("lr");
  if (lr == hp.end()) return;
  for (auto& group : opt.param_groups()) group.options().set_lr(lr->second);
}

class Member final : public ServedWorker {
 public:
  explicit Member(const MemberSetup& s)
      : s_(s),
        opt_(*s.options),
        header_(*reinterpret_cast<PopHeader*>(s.base)),
        area_(memberArea(s.base, s.layout, s.rank)),
        control_(*area_.control),
        channel_(header_.command_seq, WorkerWords{&control_.phase, &control_.done_seq}, s.parent),
        n_(static_cast<int>(s.layout.sizes.workers)),
        buffer_(s.layout.payloadBytes() + kAlign) {}

  int run() { return serveCommands(*this, channel_, header_.remaining, s_.start_seq); }

  bool arrivesAtStart() const override {
    return static_cast<Restart>(control_.restart) != Restart::kArrivedAlready;
  }

  bool stopCommanded() const override {
    return static_cast<Command>(header_.command) == Command::kStop;
  }

  bool serve() override {
    if (control_.status != static_cast<std::uint32_t>(Status::kOk)) return true;
    try {
      switch (static_cast<Command>(header_.command)) {
        case Command::kTrain:
          train();
          break;
        case Command::kExploit:
          exploit();
          break;
        case Command::kPublish:
          if (control_.copied != 0) publishNow();
          break;
        default:
          break;
      }
    } catch (...) {
      failed();
    }
    return true;
  }

  void failed() noexcept override {
    control_.status = static_cast<std::uint32_t>(Status::kFailed);
    const char* what = "unknown exception (not derived from std::exception)";
    try {
      throw;
    } catch (const std::exception& e) {
      std::snprintf(control_.message, sizeof(control_.message), "%s", e.what());
      return;
    } catch (...) {
    }
    std::snprintf(control_.message, sizeof(control_.message), "%s", what);
  }

  void setUp() override {
    setPhase(Phase::kStarting);
    if (header_.resumed != 0 || static_cast<Restart>(control_.restart) != Restart::kFirst) {
      MetaValues m = readOwn();
      loadTensors(*s_.binding, s_.layout, payload());
      hp_ = hpFromArray(m.hp, *s_.hp_names);
      step_ = m.step;
      last_copy_ = m.last_copy_step;
      version_ = m.version;
      score_ = m.score;
      optimizer_ = s_.fns->make_optimizer(*s_.model, hp_);
      if (m.optimizer_bytes > 0) loadOptimizer(s_.layout.optimizerIn(payload()), m.optimizer_bytes);
      apply();
    } else {
      hp_ = s_.initial_hp;
      DecisionRng rng = DecisionRng::derive(opt_.seed, s_.rank, -1, kStreamInit);
      if (s_.fns->init_weights) s_.fns->init_weights(s_.rank, *s_.model, rng);
      optimizer_ = s_.fns->make_optimizer(*s_.model, hp_);
      if (!optimizer_) throw InvalidArgument("make_optimizer returned no optimizer");
      score_ = score();
      publishNow();  // a resumed member's latest slot already is its checkpoint
    }
  }

 private:
  void train() {
    for (std::int64_t k = 0; k < opt_.publish_interval; ++k) {
      setPhase(Phase::kTraining);
      DecisionRng rng = DecisionRng::derive(opt_.seed, s_.rank, step_, kStreamTrain);
      s_.fns->train_step(context(rng));
      ++step_;
    }
    score_ = score();
    publishNow();
  }

  void exploit() {
    setPhase(Phase::kExploiting);
    control_.copied = 0;
    PolicyInput in{s_.rank, n_, step_, std::vector<double>(static_cast<std::size_t>(n_)),
                   opt_.higher_is_better};
    for (int r = 0; r < n_; ++r) {
      MetaValues m;
      if (!read(memberArea(s_.base, s_.layout, r), &m, nullptr, {}, opt_.max_read_retries))
        throw InternalError(fmt::format("member {}: no consistent snapshot of {}", s_.rank, r));
      in.scores[static_cast<std::size_t>(r)] = m.score;
    }
    const std::int64_t since = step_ - std::max<std::int64_t>(last_copy_, 0);
    if (since < opt_.ready_interval) return;
    DecisionRng rng = DecisionRng::derive(opt_.seed, s_.rank, step_, kStreamExploit);
    const int donor = opt_.policy.chooseDonor(in, rng);
    if (donor < 0 || donor == s_.rank) return;
    if (donor >= n_) throw InvalidArgument(fmt::format("policy chose donor {} of {}", donor, n_));

    MetaValues d;
    const auto used = [&](const MetaValues& m) { return usedPayload(s_.layout, m); };
    if (!read(memberArea(s_.base, s_.layout, donor), &d, payload(), used, opt_.max_read_retries))
      throw InternalError(fmt::format("member {}: no consistent snapshot of {}", s_.rank, donor));
    const Hyperparams before = hp_;
    loadTensors(*s_.binding, s_.layout, payload());
    if (opt_.copy_optimizer_state && d.optimizer_bytes > 0)
      loadOptimizer(s_.layout.optimizerIn(payload()), d.optimizer_bytes);
    Hyperparams next = opt_.copy_hyperparams ? hpFromArray(d.hp, *s_.hp_names) : hp_;
    if (opt_.explore == Explore::kPerturb) next = perturb(next, rng);
    if (opt_.explore == Explore::kResample) next = opt_.resample(next, rng);
    for (const auto& name : *s_.hp_names)
      if (next.count(name) == 0 || next.size() != s_.hp_names->size())
        throw InvalidArgument(fmt::format("explore changed the hyperparameter names ('{}')", name));
    hp_ = next;
    apply();  // after loading the optimizer state, which carries the donor's lr
    last_copy_ = step_;

    control_.donor = donor;
    control_.donor_version = d.version;
    control_.copy_step = step_;
    control_.own_score = score_;
    control_.donor_score = d.score;
    hpToArray(before, *s_.hp_names, control_.hp_before);
    hpToArray(hp_, *s_.hp_names, control_.hp_after);
    control_.copied = 1;
    score_ = d.score;  // the weights are the donor's, scored at the same step
  }

  void publishNow() {
    setPhase(Phase::kPublishing);
    std::string state;
    if (s_.layout.sizes.optimizer_bytes > 0) {
      torch::serialize::OutputArchive archive;
      optimizer_->save(archive);
      std::ostringstream os;
      archive.save_to(os);
      state = os.str();
      if (state.size() > s_.layout.sizes.optimizer_bytes)
        throw InvalidArgument(
            fmt::format("the optimizer state takes {} bytes, more than PopulationOptions::"
                        "optimizer_state_bytes ({})",
                        state.size(), opt_.optimizer_state_bytes));
    }
    MetaValues m;
    m.version = ++version_;
    m.step = step_;
    m.last_copy_step = last_copy_;
    m.score = score_;
    m.optimizer_bytes = state.size();
    m.hp_count = static_cast<std::uint32_t>(s_.hp_names->size());
    hpToArray(hp_, *s_.hp_names, m.hp);
    std::function<void()> midway;
    if (const auto& hook = testHooks().on_publish_midway)
      midway = [&] { hook(s_.rank, m.version); };
    publish(
        area_, m,
        [&](std::byte* p) {
          writeTensors(*s_.binding, s_.layout, p);
          if (!state.empty()) std::memcpy(s_.layout.optimizerIn(p), state.data(), state.size());
        },
        midway);
  }

  MetaValues readOwn() {
    MetaValues m;
    const auto used = [&](const MetaValues& v) { return usedPayload(s_.layout, v); };
    if (!read(area_, &m, payload(), used, opt_.max_read_retries))
      throw InternalError("no consistent snapshot of this member to resume from");
    return m;
  }

  void loadOptimizer(const std::byte* bytes, std::uint64_t n) {
    std::istringstream is(std::string(reinterpret_cast<const char*>(bytes), n));
    torch::serialize::InputArchive archive;
    archive.load_from(is);
    optimizer_->load(archive);
  }

  void apply() {
    if (s_.fns->apply_hyperparams)
      s_.fns->apply_hyperparams(*optimizer_, hp_);
    else
      defaultApply(*optimizer_, hp_);
  }

  double score() {
    setPhase(Phase::kScoring);
    DecisionRng rng = DecisionRng::derive(opt_.seed, s_.rank, step_, kStreamScore);
    return s_.fns->score(context(rng));
  }

  MemberContext context(DecisionRng& rng) {
    return MemberContext{s_.rank, n_, step_, &hp_, optimizer_.get(), &rng};
  }

  std::byte* payload() {
    auto p = reinterpret_cast<std::uintptr_t>(buffer_.data());
    return reinterpret_cast<std::byte*>(alignUp(p, kAlign));
  }

  void setPhase(Phase p) { channel_.setPhase(p); }

  const MemberSetup& s_;
  const PopulationOptions& opt_;
  PopHeader& header_;
  MemberArea area_;
  MemberControl& control_;
  WorkerChannel channel_;
  int n_;
  std::vector<std::byte> buffer_;  // a private copy of one payload, 64-byte aligned
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  Hyperparams hp_;
  std::int64_t step_ = 0;
  std::int64_t last_copy_ = -1;
  std::uint64_t version_ = 0;
  double score_ = 0;
};
}  // namespace

int runMember(const MemberSetup& setup) {
  if (setup.options->keep_worker_memory) keepFreedMemory();
  at::set_num_threads(setup.threads);
  setBlasThreads(setup.threads);  // a BLAS with a pool of its own (gradagg/blas.h)
  Member member(setup);
  return member.run();
}

}  // namespace gradagg::detail::pop
