# Runs one command and checks its exit code and output.
#   cmake -DCOMMAND=<program|arg|arg...> -DEXPECT_RC=<n> [-DEXPECT_REGEX=<regex>]
#         [-DREJECT_REGEX=<regex>] [-DGOLDEN=<file>] -P run_cli.cmake
# EXPECT_REGEX must match stdout+stderr and REJECT_REGEX must not (what should not have run); GOLDEN must equal stdout byte for byte (dtsim
# is deterministic, so golden outputs need no tolerance).
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL EXPECT_RC)
  message(FATAL_ERROR "exit code ${rc}, expected ${EXPECT_RC}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(DEFINED EXPECT_REGEX AND NOT "${out}${err}" MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "output does not match '${EXPECT_REGEX}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(DEFINED REJECT_REGEX AND "${out}${err}" MATCHES "${REJECT_REGEX}")
  message(FATAL_ERROR "output matches '${REJECT_REGEX}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(DEFINED GOLDEN)
  file(READ "${GOLDEN}" expected)
  if(NOT out STREQUAL expected)
    file(WRITE "${GOLDEN}.actual" "${out}")
    message(FATAL_ERROR "stdout differs from ${GOLDEN} (actual output in ${GOLDEN}.actual)")
  endif()
endif()
