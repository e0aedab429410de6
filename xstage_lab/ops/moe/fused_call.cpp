// The eager call of a FusedMoE whose graph is captured (xstage_lab/ops/moe/op.py), in one host
// function: the inputs checked, the output allocated, the argument block's addresses put into
// the graph's writer node, the graph launched. The same steps in Python cost the host about
// three times as long per call (moe_layer's host_<step>_us columns); the driver's two calls
// stay as they are.
//
// Host code only. The driver is reached through the function pointers Python's ctypes binding
// resolved (graph_launch.py), so this file needs neither cuda.h nor libcuda at build time. A
// call this path does not take (no graph for the key yet, the stream capturing, an input the
// contract check would refuse, an input autograd records, another device current, a stream
// other than the latest call's over the layer's buffers) returns None, and the Python path runs:
// it raises the contract's errors, captures the graph, launches into the user's capture, goes
// through the custom op, whose output's backward raises, makes the layer's device current for
// the call, or has the call's stream wait for the latest call's (graph_launch.StreamOrder).
// torch/python.h, not torch/extension.h: at::Tensor, pybind11 and ATen's global context (the
// deterministic flag) are all this file takes, and extension.h adds the header of every ATen
// operator, a third of the build's time (50 s against 33 s on a two-core machine).
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <torch/python.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using SetParams = int (*)(void* exec, void* node, const void* params);
using GraphLaunch = int (*)(void* exec, void* stream);
using StreamIsCapturing = int (*)(void* stream, int* status);
using CtxGetDevice = int (*)(int* device);

constexpr int kTensors = 5;     // ids, x, Combine rows, weights, output: op.FusedMoE's order

struct Graph {
  void* exec;
  void* node;
  const void* params;  // the node's CUDA_KERNEL_NODE_PARAMS, owned by the GraphLauncher
  uint64_t* words;     // its address arguments inside the parameter block it points to
};

class FusedCall {
 public:
  // slots: per argument-block slot, the index of its tensor in (ids, x, combine, weights, y),
  // or -1 for the block's own address (call_args.slot_order); aligned: the tensor indices that
  // must start align-byte aligned; functions: cuGraphExecKernelNodeSetParams, cuGraphLaunch,
  // cuStreamIsCapturing, cuCtxGetDevice (graph_launch.call_functions); latest_stream: where
  // the CUstream of the latest call over the layer's buffers is kept (StreamOrder.address).
  FusedCall(std::vector<int64_t> slots, std::vector<int64_t> aligned, int64_t align, int64_t own,
            int64_t combine, int64_t hidden, int64_t top_k, int64_t max_tokens,
            std::vector<at::ScalarType> weight_dtypes, torch::Device device,
            std::array<int64_t, 4> functions, int64_t latest_stream)
      : slots_(std::move(slots)), aligned_(std::move(aligned)), align_(align), own_(own),
        combine_(combine),
        hidden_(hidden), top_k_(top_k), max_tokens_(max_tokens),
        weight_dtypes_(std::move(weight_dtypes)), device_(device),
        set_params_(reinterpret_cast<SetParams>(functions[0])),
        graph_launch_(reinterpret_cast<GraphLaunch>(functions[1])),
        is_capturing_(reinterpret_cast<StreamIsCapturing>(functions[2])),
        current_device_(reinterpret_cast<CtxGetDevice>(functions[3])),
        latest_stream_(reinterpret_cast<const int64_t*>(latest_stream)) {}

  // deterministic: torch's deterministic-algorithms flag the graph was captured under (a
  // FusedMoE's "auto" weighted sum picks its launches by it)
  void add(int64_t tokens, at::ScalarType id_dtype, at::ScalarType weight_dtype,
           bool deterministic, int64_t exec, int64_t node, int64_t params, int64_t words) {
    graphs_[key(tokens, id_dtype, weight_dtype, deterministic)] = {
        reinterpret_cast<void*>(exec), reinterpret_cast<void*>(node),
        reinterpret_cast<const void*>(params), reinterpret_cast<uint64_t*>(words)};
  }

  void remove(int64_t tokens, at::ScalarType id_dtype, at::ScalarType weight_dtype,
              bool deterministic) {
    graphs_.erase(key(tokens, id_dtype, weight_dtype, deterministic));
  }

  int64_t size() const { return static_cast<int64_t>(graphs_.size()); }

  std::optional<torch::Tensor> call(const torch::Tensor& x, const torch::Tensor& ids,
                                    const torch::Tensor& weights, int64_t stream) {
    if (x.device() != device_ || ids.device() != device_ || weights.device() != device_ ||
        x.scalar_type() != at::kBFloat16 || x.dim() != 2 || x.size(1) != hidden_ ||
        !x.is_contiguous() || !ids.is_contiguous() || !weights.is_contiguous() ||
        (at::GradMode::is_enabled() && (x.requires_grad() || weights.requires_grad())))
      return std::nullopt;
    const int64_t tokens = x.size(0);
    const auto id_dtype = ids.scalar_type();
    const auto weight_dtype = weights.scalar_type();
    if (tokens < 1 || tokens > max_tokens_ || ids.dim() != 2 || ids.size(0) != tokens ||
        ids.size(1) != top_k_ || weights.dim() != 2 || weights.size(0) != tokens ||
        weights.size(1) != top_k_ || (id_dtype != at::kInt && id_dtype != at::kLong) ||
        std::find(weight_dtypes_.begin(), weight_dtypes_.end(), weight_dtype) ==
            weight_dtypes_.end())
      return std::nullopt;
    auto found = graphs_.find(
        key(tokens, id_dtype, weight_dtype, at::globalContext().deterministicAlgorithms()));
    if (found == graphs_.end()) return std::nullopt;
    // the Python path's: a call from another device (a model split over GPUs in one process;
    // its launches go to the current one: GraphCache.call), with no context current, or on a
    // stream other than the latest call's, which must wait for it (StreamOrder.follow)
    int current = -1;
    if (current_device_(&current) || current != device_.index() || stream != *latest_stream_)
      return std::nullopt;
    void* cu_stream = reinterpret_cast<void*>(stream);
    int capturing = 0;
    check(is_capturing_(cu_stream, &capturing), "cuStreamIsCapturing");
    if (capturing) return std::nullopt;
    torch::Tensor y = torch::empty_like(x);
    const std::array<int64_t, kTensors> addresses = {
        reinterpret_cast<int64_t>(ids.data_ptr()), reinterpret_cast<int64_t>(x.data_ptr()),
        combine_, reinterpret_cast<int64_t>(weights.data_ptr()),
        reinterpret_cast<int64_t>(y.data_ptr())};
    for (int64_t i : aligned_)
      if (addresses[i] % align_) return std::nullopt;  // the Python path says which
    const Graph& g = found->second;
    for (size_t s = 0; s < slots_.size(); ++s)
      g.words[s] = static_cast<uint64_t>(slots_[s] < 0 ? own_ : addresses[slots_[s]]);
    check(set_params_(g.exec, g.node, g.params), "cuGraphExecKernelNodeSetParams");
    check(graph_launch_(g.exec, cu_stream), "cuGraphLaunch");
    return y;
  }

 private:
  // T, the ids' and the weights' dtypes, torch's deterministic flag
  using Key = std::tuple<int64_t, int, int, bool>;

  static Key key(int64_t tokens, at::ScalarType ids, at::ScalarType weights, bool deterministic) {
    return {tokens, static_cast<int>(ids), static_cast<int>(weights), deterministic};
  }

  static void check(int result, const char* call) {
    if (result) throw std::runtime_error(std::string(call) + " failed: CUresult " +
                                         std::to_string(result));
  }

  std::vector<int64_t> slots_, aligned_;
  int64_t align_, own_, combine_, hidden_, top_k_, max_tokens_;
  std::vector<at::ScalarType> weight_dtypes_;
  torch::Device device_;
  SetParams set_params_;
  GraphLaunch graph_launch_;
  StreamIsCapturing is_capturing_;
  CtxGetDevice current_device_;
  const int64_t* latest_stream_;
  std::map<Key, Graph> graphs_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<FusedCall>(m, "FusedCall")
      .def(pybind11::init<std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, std::vector<at::ScalarType>, torch::Device,
                          std::array<int64_t, 4>, int64_t>())
      .def("add", &FusedCall::add)
      .def("remove", &FusedCall::remove)
      .def("__len__", &FusedCall::size)
      .def("__call__", &FusedCall::call);
}
