#include "compile_on_demand.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

extern char** environ;

namespace fmha::detail {
namespace {

// The driver's exit status when there is nothing it can compile here (no CUDA compiler, a build
// without the sources, no instance in the matrix for the recipe); its stdout says why. jit.py's
// main() defines it.
constexpr int kNothingToCompile = 3;
// The compiler's message is the end of what it wrote: its last errors, the command that failed.
constexpr size_t kStderrTailBytes = 8192;

// The folder libfmha was loaded from: a package's (fmha/ of a wheel or of a development
// build's python/ folder), where the compile driver and its configuration sit beside it.
std::string library_directory() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&library_directory), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The Python that runs the driver: FMHA_PYTHON (the fmha package sets it to its own interpreter,
// whose environment holds the generator's packages), else the one the build configured with,
// else python3 on PATH.
std::string python_interpreter() {
  const char* chosen = std::getenv("FMHA_PYTHON");
  if (chosen != nullptr && *chosen != '\0') return chosen;
#ifdef FMHA_BUILD_PYTHON_EXECUTABLE
  if (access(FMHA_BUILD_PYTHON_EXECUTABLE, X_OK) == 0) return FMHA_BUILD_PYTHON_EXECUTABLE;
#endif
  return "python3";
}

struct ChildResult {
  int exit_code = -1;    // -1: it did not exit normally
  std::string out;       // all of its stdout
  std::string err_tail;  // the end of its stderr
};

// Runs `argv` (PATH searched), its stderr echoed to ours as it comes (the driver says what it
// compiles and how long that takes) and kept in part; false with `why` when it could not run.
bool run_child(const std::vector<std::string>& argv, ChildResult* result, std::string* why) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    *why = std::string("pipe: ") + std::strerror(errno);
    return false;
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    *why = std::string("pipe: ") + std::strerror(errno);
    close(out_pipe[0]);
    close(out_pipe[1]);
    return false;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (spawned != 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    *why = "cannot run " + argv[0] + ": " + std::strerror(spawned);
    return false;
  }
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buffer[4096];
  while (open_fds > 0) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (pollfd& fd : fds) {
      if (fd.fd < 0 || fd.revents == 0) continue;
      const ssize_t n = read(fd.fd, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        close(fd.fd);
        fd.fd = -1;
        --open_fds;
        continue;
      }
      if (fd.fd == out_pipe[0]) {
        result->out.append(buffer, n);
      } else {
        (void)!write(STDERR_FILENO, buffer, n);
        result->err_tail.append(buffer, n);
        if (result->err_tail.size() > kStderrTailBytes) {
          result->err_tail.erase(0, result->err_tail.size() - kStderrTailBytes);
        }
      }
    }
  }
  for (const pollfd& fd : fds) {
    if (fd.fd >= 0) close(fd.fd);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      *why = std::string("waitpid: ") + std::strerror(errno);
      return false;
    }
  }
  result->exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return true;
}

std::string trimmed(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(" \t\r\n") - begin + 1);
}

// The last line of the driver's stdout: the path of the object it compiled or found.
std::string last_line(const std::string& text) {
  const std::string body = trimmed(text);
  const size_t newline = body.rfind('\n');
  return newline == std::string::npos ? body : body.substr(newline + 1);
}

Status miss_because(const Status& miss, const std::string& why) {
  return {miss.code, miss.message + "; " + why};
}

// Whether `stream` is capturing a CUDA graph (or cannot say: the legacy stream while another
// stream captures in global mode answers with an error).
bool capturing(Stream stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();  // a query's error: nothing launched failed
    return true;
  }
  return capture != cudaStreamCaptureStatusNone;
}

}  // namespace

Status compile_on_demand(const InstanceRecipe& recipe, Stream stream, const Status& miss) {
  const char* jit = std::getenv("FMHA_JIT");
  if ((jit != nullptr && std::strcmp(jit, "0") == 0) || recipe.target.empty()) return miss;
  const std::string directory = library_directory();
  const std::string driver = directory + "/jit.py";
  if (directory.empty() || access(driver.c_str(), R_OK) != 0 ||
      access((directory + "/_jit_config.json").c_str(), R_OK) != 0) {
    return miss;  // a library without the Python package's sources (a C++-only build)
  }
  const std::string command = "python -m fmha.jit --filter '" + recipe.filter + "' --target " +
                              recipe.target;
  if (capturing(stream)) {
    return miss_because(miss, "compile on demand does not run inside a CUDA-graph capture: "
                              "run the call once before capturing, or fill the cache first (" +
                              command + ")");
  }
  static std::mutex compiling;
  std::lock_guard<std::mutex> lock(compiling);
  ChildResult child;
  std::string why;
  if (!run_child({python_interpreter(), driver, "--filter", recipe.filter, "--target",
                  recipe.target},
                 &child, &why)) {
    return miss_because(miss, "compiling it on demand failed: " + why);
  }
  if (child.exit_code == kNothingToCompile) return miss;
  if (child.exit_code != 0) {
    return miss_because(miss, "compiling it on demand (" + command + ") failed:\n" +
                                  trimmed(child.err_tail));
  }
  const std::string library = last_line(child.out);
  if (Status loaded = load_instances(library); !loaded.ok()) {
    return miss_because(miss, "loading what compile on demand made failed: " + loaded.message);
  }
  return Status::Ok();
}

}  // namespace fmha::detail
