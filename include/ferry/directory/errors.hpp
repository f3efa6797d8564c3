#pragma once
// The directory's own error codes: what a lookup, a publication or a watch ends with, and the two
// reasons a transfer bound to a peer's incarnation fails (peer_restarted, peer_gone).

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry {

/// The directory's error codes (category "ferry.directory").
enum class directory_errc : int {
  bad_name = 1,         ///< a name or prefix is empty, too long, or has a character not allowed
  record_too_large,     ///< a record is larger than the directory's max_record_bytes
  bad_record,           ///< bytes under a name are no ferry directory record (garbage, cut, altered)
  not_found,            ///< nothing is published under the name
  unavailable,          ///< the directory service did not answer (etcd stopped or unreachable)
  deadline_exceeded,    ///< the operation's deadline passed first
  closed,               ///< the directory or the watch was closed before the operation ended
  lease_lost,           ///< the publication's lease expired or was revoked while it was held
  peer_restarted,       ///< the peer published a newer incarnation: this endpoint's peer is gone
  peer_gone,            ///< the peer's lease expired or it withdrew: nobody is under the name now
  watch_overflowed,     ///< a watcher fell behind by more events than it buffers: watch again
  service_error,        ///< the directory service refused a request; the message says what it said
  superseded,           ///< a newer incarnation was published under the name: this one lost it
};

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(directory_errc e) noexcept {
  switch (e) {
    case directory_errc::bad_name:
      return "name is empty, longer than 255 bytes, or has a character other than A-Z a-z 0-9 . _ "
             "- : /";
    case directory_errc::record_too_large: return "record is larger than the directory allows";
    case directory_errc::bad_record: return "bytes under the name are not a ferry directory record";
    case directory_errc::not_found: return "nothing is published under the name";
    case directory_errc::unavailable: return "the directory service did not answer";
    case directory_errc::deadline_exceeded: return "the deadline passed before the directory answered";
    case directory_errc::closed: return "the directory or watch was closed";
    case directory_errc::lease_lost: return "the publication's lease expired or was revoked";
    case directory_errc::peer_restarted:
      return "the peer restarted: the directory shows a newer incarnation under its name";
    case directory_errc::peer_gone:
      return "the peer is gone: its lease expired or it withdrew its name";
    case directory_errc::watch_overflowed:
      return "the watcher fell behind by more events than it buffers";
    case directory_errc::service_error: return "the directory service refused the request";
    case directory_errc::superseded:
      return "a newer incarnation was published under the name: this publication no longer holds it";
  }
  return nullptr;
}

/// The category of ferry::directory_errc, named "ferry.directory".
[[nodiscard]] inline const std::error_category& directory_category() noexcept {
  return ferry::detail::error_category_of<directory_errc, describe>("ferry.directory");
}

/// `e` as a std::error_code in directory_category().
[[nodiscard]] inline std::error_code make_error_code(directory_errc e) noexcept {
  return {static_cast<int>(e), directory_category()};
}

}  // namespace ferry

/// Makes ferry::directory_errc an error-code enum: it converts to std::error_code and compares.
template <>
struct std::is_error_code_enum<ferry::directory_errc> : std::true_type {};
