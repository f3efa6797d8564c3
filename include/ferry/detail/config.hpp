#pragma once
// What every ferry header needs of the compiler. ferry is C++20 (coroutines, concepts); an older
// translation unit stops here with one clear message rather than pages of errors from the headers.
// MSVC reports __cplusplus as 199711L unless /Zc:__cplusplus is given, so there the standard it
// compiles to is read from _MSVC_LANG.

#if defined(_MSVC_LANG)
#define FERRY_DETAIL_CPLUSPLUS _MSVC_LANG
#else
#define FERRY_DETAIL_CPLUSPLUS __cplusplus
#endif

#if FERRY_DETAIL_CPLUSPLUS < 202002L
#error "ferry needs C++20 or newer: compile with -std=c++20 (or later; /std:c++20 with MSVC)"
#endif
