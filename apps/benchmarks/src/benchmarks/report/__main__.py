from benchmarks.report.build import main

main()
