// PrefixCache: the block hash and the registry.
#include "prefix_cache.hpp"

namespace pagedattn {

namespace {

constexpr std::uint64_t kK0 = 0xa0761d6478bd642full;
constexpr std::uint64_t kK1 = 0xe7037ed1a0b428dbull;
constexpr std::uint64_t kK2 = 0x8ebc6af09c88c6e3ull;
constexpr std::uint64_t kK3 = 0x589965cc75374cc3ull;
constexpr std::uint64_t kK4 = 0x1d8e4e27c47d124full;
constexpr std::uint64_t kK5 = 0x9e3779b97f4a7c15ull;

// 64 x 64 -> 128-bit multiply, folded by xor (the wyhash "mum" mixer).
inline std::uint64_t mum(std::uint64_t a, std::uint64_t b) {
#if defined(__SIZEOF_INT128__)
  const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
  return static_cast<std::uint64_t>(r) ^ static_cast<std::uint64_t>(r >> 64);
#else
  const std::uint64_t al = a & 0xffffffffull, ah = a >> 32, bl = b & 0xffffffffull, bh = b >> 32;
  const std::uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
  const std::uint64_t mid = (ll >> 32) + (lh & 0xffffffffull) + (hl & 0xffffffffull);
  const std::uint64_t lo = (ll & 0xffffffffull) | (mid << 32);
  const std::uint64_t hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
  return lo ^ hi;
#endif
}

inline std::uint64_t word(const std::int32_t* t) {
  return static_cast<std::uint64_t>(static_cast<std::uint32_t>(t[0])) |
         (static_cast<std::uint64_t>(static_cast<std::uint32_t>(t[1])) << 32);
}

}  // namespace

PrefixCache::PrefixCache(std::int32_t num_blocks, std::int64_t block_size, bool enabled)
    : enabled_(enabled), bs_(block_size) {
  if (!enabled) return;
  const auto nb = static_cast<std::size_t>(num_blocks);
  block_node_.assign(nb, -1);
  nodes_.reserve(nb);
  tokens_.reserve(nb * static_cast<std::size_t>(bs_));
}

Hash128 PrefixCache::hash(const Hash128& prev, std::uint64_t extra, const std::int32_t* t) const {
  // Two 64-bit lanes with independent seeds; each absorbs two token ids per multiply.
  std::uint64_t a = mum(prev.lo ^ kK0, extra ^ kK1);
  std::uint64_t b = mum(prev.hi ^ kK2, extra ^ kK3);
  std::int64_t i = 0;
  for (; i + 4 <= bs_; i += 4) {
    const std::uint64_t w0 = word(t + i), w1 = word(t + i + 2);
    a = mum(w0 ^ kK1 ^ a, w1 ^ kK2);
    b = mum(w0 ^ kK4 ^ b, w1 ^ kK5);
  }
  for (; i < bs_; ++i) {
    const std::uint64_t w = static_cast<std::uint32_t>(t[i]);
    a = mum(w ^ kK3 ^ a, kK0);
    b = mum(w ^ kK5 ^ b, kK2);
  }
  Hash128 h;
  h.lo = mum(a ^ kK4, b ^ kK0);
  h.hi = mum(b ^ kK1, a ^ kK3);
  return h;
}

PrefixCache::Node PrefixCache::new_node(const Hash128& h, Node parent, std::uint64_t extra,
                                        const std::int32_t* tokens) {
  Node n;
  if (!free_nodes_.empty()) {
    n = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    n = static_cast<Node>(nodes_.size());
    nodes_.emplace_back();
    tokens_.resize(tokens_.size() + static_cast<std::size_t>(bs_));
  }
  NodeRec& r = nodes_[static_cast<std::size_t>(n)];
  r = NodeRec{h, extra, parent, -1, 0, true, false};
  std::memcpy(&tokens_[static_cast<std::size_t>(n) * static_cast<std::size_t>(bs_)], tokens,
              static_cast<std::size_t>(bs_) * sizeof(std::int32_t));
  retain(parent);
  return n;
}

void PrefixCache::release(Node n) {
  // A node nobody refers to is freed, which drops its reference on its parent.
  while (n != kRoot) {
    NodeRec& r = nodes_[static_cast<std::size_t>(n)];
    if (--r.refs > 0) return;
    if (r.indexed) map_.erase(r.hash.lo);
    r.live = false;
    free_nodes_.push_back(n);
    n = r.parent;
  }
}

std::int32_t PrefixCache::insert(std::int32_t b, const Hash128& h, Node parent, std::uint64_t extra,
                                 const std::int32_t* tokens, Node* node) {
  std::int32_t displaced = -1;
  Node n = map_.find(h.lo);
  if (n >= 0 && same(n, h, parent, extra, tokens)) {  // this prefix has a node: attach b to it
    NodeRec& r = nodes_[static_cast<std::size_t>(n)];
    if (r.block >= 0) {  // newest wins: the older holder keeps its contents but leaves the cache
      displaced = r.block;
      block_node_[static_cast<std::size_t>(displaced)] = -1;
      --num_registered_;
    } else {
      ++r.refs;
    }
    r.block = b;
  } else {
    if (n >= 0) {  // a different prefix under the same key: it leaves the index (and the cache)
      map_.erase(h.lo);
      NodeRec& r = nodes_[static_cast<std::size_t>(n)];
      r.indexed = false;
      if (r.block >= 0) {
        displaced = r.block;
        block_node_[static_cast<std::size_t>(displaced)] = -1;
        --num_registered_;
        r.block = -1;
        release(n);
      }
    }
    n = new_node(h, parent, extra, tokens);
    NodeRec& r = nodes_[static_cast<std::size_t>(n)];
    r.block = b;
    r.refs = 1;
    map_.insert(h.lo, n);
    r.indexed = true;
  }
  block_node_[static_cast<std::size_t>(b)] = n;
  ++num_registered_;
  *node = n;
  return displaced;
}

void PrefixCache::erase(std::int32_t b) {
  const Node n = block_node_[static_cast<std::size_t>(b)];
  block_node_[static_cast<std::size_t>(b)] = -1;
  --num_registered_;
  nodes_[static_cast<std::size_t>(n)].block = -1;
  release(n);
}

}  // namespace pagedattn
