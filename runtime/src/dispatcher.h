// Instance selection, for each operation's table (fwd, bwd, kvcache): the functional match on a
// problem's traits and head dims, the device's architecture, then the instance's own
// constraints (tile divisibility), over the generator's order of preference (the table is
// sorted). generator/dispatch.py mirrors the rule.
#pragma once

#include "fmha/fmha.h"
#include "fmha/registry.h"

#include <string>

namespace fmha::detail {

// Compute capability of the current device as major*10+minor, or a failed status.
Status current_device_cc(int* cc);

// current_device_cc for a call that launches, with the device's primary context bound to the
// calling thread. The runtime binds a thread lazily, at its first call that needs a context;
// on a thread whose first CUDA call is fmha's (an autograd engine's device thread, a new
// thread of the caller's) the fa3 launchers would encode their TMA descriptors, driver calls,
// with none bound: CUDA_ERROR_INVALID_CONTEXT, then a launch with unset descriptors.
Status launch_device_cc(int* cc);

// The entry that runs `args` on a device of compute capability `cc`, or a kNoInstance status
// naming the traits asked for, the nearest compiled instances and the filter that builds one.
Status select_instance(const FwdArgs& args, int cc, const FwdInstanceEntry** chosen);
Status select_instance(const BwdArgs& args, int cc, const BwdInstanceEntry** chosen);
Status select_instance(const KvcacheArgs& args, int cc, const KvcacheInstanceEntry** chosen);

// The entry called `name`, if it can run `args` on a device of compute capability `cc`; if it
// cannot, the status names the condition that fails.
Status find_instance(const std::string& name, const FwdArgs& args, int cc,
                     const FwdInstanceEntry** chosen);
Status find_instance(const std::string& name, const BwdArgs& args, int cc,
                     const BwdInstanceEntry** chosen);
Status find_instance(const std::string& name, const KvcacheArgs& args, int cc,
                     const KvcacheInstanceEntry** chosen);

// select_instance() in words: the chosen entry, why it ranks before every other entry that
// could run `args` and, when an older pipeline runs it, the rules of instances.yaml that leave
// the newer one without these traits; or on a miss the nearest entries and the filter that
// builds one.
std::string explain_selection(const FwdArgs& args, int cc);
std::string explain_selection(const BwdArgs& args, int cc);
std::string explain_selection(const KvcacheArgs& args, int cc);

InstanceInfo to_info(const FwdInstanceEntry& entry);
BwdInstanceInfo to_info(const BwdInstanceEntry& entry);
KvcacheInstanceInfo to_info(const KvcacheInstanceEntry& entry);

}  // namespace fmha::detail
