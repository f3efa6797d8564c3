#pragma once
// Peers by name: a directory where each engine publishes its record (the KV handshake, a worker
// address) under a name with a lease the progress executor keeps alive, looks others up (many at
// once, with one deadline), watches names come and go, and binds endpoints to a peer's incarnation
// so that a restarted or dead peer fails its transfers at once (named_peer). The in-process
// directory is here; etcd_directory needs libcurl and is in <ferry/directory/etcd.hpp>.

#include "ferry/detail/config.hpp"
#include "ferry/directory/directory.hpp"
#include "ferry/directory/errors.hpp"
#include "ferry/directory/local.hpp"
#include "ferry/directory/named_peer.hpp"
#include "ferry/directory/pending.hpp"
#include "ferry/directory/record.hpp"
