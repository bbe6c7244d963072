"""`python -m eval.gpu_check [flags]`: the GPU check's command line (the flags: eval.gpu_check.settings)."""

from eval.gpu_check.run import main

if __name__ == "__main__":
    main()
