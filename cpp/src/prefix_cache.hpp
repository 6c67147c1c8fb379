// PrefixCache: the registry of full, computed blocks that later sequences may reuse.
//
// A hit must be exact, not merely probable. The cache keeps a tree of prefix nodes: a node
// stands for one exact prefix of blocks (its parent node, the sequence's extra key and the
// block's exact token ids), and a registered block is attached to the node of the prefix it
// was computed after. match() accepts block i of a prompt only when the node it finds has
// the node accepted at i - 1 as its parent (the root for i = 0), the same extra key and the
// same tokens, and a block attached. By induction the accepted blocks were computed after
// exactly the prompt's prefix, so no hash collision, constructed or accidental, produces a
// hit; a collision only costs one. The chained 128-bit hash only finds candidate nodes.
// Token ids are any int32 values: they are compared exactly.
//
// A node lives while a registered block, a child node or a sequence's chain refers to it
// (reference counts), so a prefix whose blocks were evicted and computed again is the same
// node, and blocks registered after it are found again. When two blocks hold the same
// prefix, the newer registration wins and the older block is unregistered (returned to the
// caller, who updates the pool). The cache holds no block references: which registered
// blocks are in use or evictable is the pool's business (BlockPool).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "id_map.hpp"

namespace pagedattn {

struct Hash128 {
  std::uint64_t lo = 0, hi = 0;
  bool operator==(const Hash128& o) const { return lo == o.lo && hi == o.hi; }
};

class PrefixCache {
 public:
  using Node = std::int32_t;
  static constexpr Node kRoot = -1;  // the empty prefix

  // A link of a sequence's chain: the hash and node of one of its registered blocks. A
  // sequence holds a reference on each of its links' nodes (retain / release).
  struct Link {
    Hash128 hash;
    Node node = kRoot;
  };

  PrefixCache() = default;
  // An empty registry for num_blocks blocks of block_size tokens; disabled = no storage.
  PrefixCache(std::int32_t num_blocks, std::int64_t block_size, bool enabled);

  bool enabled() const { return enabled_; }
  // The chain link that precedes a sequence's first block.
  static Link root() { return Link{Hash128{0x243f6a8885a308d3ull, 0x13198a2e03707344ull}, kRoot}; }
  // Chain hash of one block of block_size tokens after the block hashed `prev`.
  Hash128 hash(const Hash128& prev, std::uint64_t extra, const std::int32_t* tokens) const;

  bool is_registered(std::int32_t b) const {
    return enabled_ && block_node_[static_cast<std::size_t>(b)] >= 0;
  }
  Node node_of(std::int32_t b) const { return block_node_[static_cast<std::size_t>(b)]; }  // b registered
  std::int64_t num_registered() const { return num_registered_; }

  // Walks the first max_blocks blocks of `tokens` and calls on_hit(block, hash, node) for
  // each block of the longest exactly matching cached prefix. Returns the number of blocks matched.
  template <class OnHit>
  std::int64_t match(const std::int32_t* tokens, std::int64_t max_blocks, std::uint64_t extra,
                     OnHit&& on_hit) const {
    Hash128 prev_hash = root().hash;
    Node prev = kRoot;
    std::int64_t k = 0;
    for (; k < max_blocks; ++k) {
      const std::int32_t* t = tokens + k * bs_;
      const Hash128 h = hash(prev_hash, extra, t);
      const Node n = map_.find(h.lo);
      if (n < 0 || !same(n, h, prev, extra, t)) break;
      const std::int32_t b = nodes_[static_cast<std::size_t>(n)].block;
      if (b < 0) break;
      on_hit(b, h, n);
      prev_hash = h;
      prev = n;
    }
    return k;
  }

  // Registers block b (not registered) with its tokens, after the prefix `parent`, under
  // hash h. Returns the block this unregisters (the older holder of the same prefix, or of
  // a colliding hash), else -1; *node receives b's node (not yet retained by a sequence).
  std::int32_t insert(std::int32_t b, const Hash128& h, Node parent, std::uint64_t extra,
                      const std::int32_t* tokens, Node* node);
  // Unregisters block b (registered).
  void erase(std::int32_t b);
  // A sequence's chain takes / drops a reference on a node (kRoot is ignored).
  void retain(Node n) {
    if (n != kRoot) ++nodes_[static_cast<std::size_t>(n)].refs;
  }
  void release(Node n);

  // For the invariant checker.
  struct NodeView {
    bool live;
    bool indexed;  // the hash index finds this node
    Node parent;
    std::int32_t block;  // registered block, or -1
    std::int32_t refs;
  };
  std::int64_t num_nodes() const { return static_cast<std::int64_t>(nodes_.size()); }
  NodeView node(Node n) const {
    const NodeRec& r = nodes_[static_cast<std::size_t>(n)];
    return NodeView{r.live, r.live && r.indexed && map_.find(r.hash.lo) == n, r.parent, r.block, r.refs};
  }

 private:
  struct NodeRec {
    Hash128 hash;
    std::uint64_t extra = 0;
    Node parent = kRoot;
    std::int32_t block = -1;  // the registered block holding this prefix, or -1
    std::int32_t refs = 0;    // registered block + child nodes + sequence links
    bool live = false;
    bool indexed = false;  // map_ holds hash.lo -> this node
  };
  bool same(Node n, const Hash128& h, Node parent, std::uint64_t extra, const std::int32_t* tokens) const {
    const NodeRec& r = nodes_[static_cast<std::size_t>(n)];
    return r.hash == h && r.parent == parent && r.extra == extra &&
           std::memcmp(&tokens_[static_cast<std::size_t>(n) * static_cast<std::size_t>(bs_)], tokens,
                       static_cast<std::size_t>(bs_) * sizeof(std::int32_t)) == 0;
  }
  Node new_node(const Hash128& h, Node parent, std::uint64_t extra, const std::int32_t* tokens);

  bool enabled_ = false;
  std::int64_t bs_ = 0;
  std::vector<Node> block_node_;  // per block: its node, or -1 when not registered
  std::int64_t num_registered_ = 0;
  std::vector<NodeRec> nodes_;
  std::vector<std::int32_t> tokens_;  // [nodes_.size() * block_size]
  std::vector<Node> free_nodes_;
  IdMap map_;  // hash.lo -> node (one node per key: a colliding newer prefix takes the key)
};

}  // namespace pagedattn
