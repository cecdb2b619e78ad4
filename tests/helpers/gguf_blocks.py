"""Where each GGUF block type keeps its float16 fields, for tests that write random blocks."""

# byte offset in the block -> "d" (a scale) or "m" (a minimum: Q4_1's and Q5_1's m, the K-quants' dmin)
HALVES = {
    "Q4_0": {0: "d"}, "Q4_1": {0: "d", 2: "m"}, "Q5_0": {0: "d"}, "Q5_1": {0: "d", 2: "m"}, "Q8_0": {0: "d"},
    "IQ4_NL": {0: "d"}, "Q4_K": {0: "d", 2: "m"}, "Q5_K": {0: "d", 2: "m"}, "Q6_K": {208: "d"},
    "IQ4_XS": {0: "d"}, "Q3_K": {108: "d"},
}  # fmt: skip
