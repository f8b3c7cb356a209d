// A population's checkpoint: one LibTorch archive, a sub-archive per member
// (p<k>, b<k>, meta [version, step, last_copy_step], score, hp in name order,
// optimizer bytes), written durably and CRC-checked (checkpoint/durable_file.h).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <gradagg/population.h>

#include "model/model_binding.h"
#include "population/layout.h"

namespace gradagg::detail::pop {

// Writes every member's snapshot to `path`.
void saveMembers(const std::string& path, const std::vector<MemberSnapshot>& members,
                 const std::vector<std::string>& hp_names);

// Before fork: each member's checkpointed state becomes its latest snapshot in
// its area (`area(r)`). Throws CheckpointError (unreadable, corrupt) or
// InvalidArgument (another member count, other hyperparameters, an optimizer
// state bigger than the layout's room).
void loadMembers(const std::string& path, int workers, const std::vector<std::string>& hp_names,
                 const ModelBinding& binding, const PopLayout& layout,
                 const std::function<MemberArea(int)>& area);

}  // namespace gradagg::detail::pop
