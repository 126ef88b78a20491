// Compile on demand, for every entry point that launches or sizes a launch's workspace: a call
// that no loaded instance runs has the instances that would run it compiled and loaded, then is
// dispatched again. The compiling is the Python package's (fmha/jit.py beside libfmha, run as a
// program): it renders them with the generator and templates the build used and compiles them
// with the build's compiler into a cache shared by every process; load_instances adds them to
// the dispatcher where a full build would have put them.
#pragma once

#include "fmha/fmha.h"

namespace fmha::detail {

// Has the instances of `recipe` (instance_recipe() of the call that missed) compiled and
// loaded. Ok when it did: dispatch again. Otherwise the miss: `miss` itself where compile on
// demand is off (FMHA_JIT=0, no compile driver beside this library, no CUDA compiler, no
// target for the device, nothing in the matrix that runs the call), or `miss` with the reason
// appended where it refused (`stream` capturing a CUDA graph) or compiling failed (the
// compiler's message). Serialized within the process; the driver's locks serialize processes.
Status compile_on_demand(const InstanceRecipe& recipe, Stream stream, const Status& miss);

}  // namespace fmha::detail
