"""Developer tools run from the repository root (not installed, not benchmarks):

    python -m tools.cluster --help    # an emulated commodity cluster (network namespaces, tc)
    python -m tools.mutation --help   # mutation testing of the compiler's and runtime's modules
"""
