from cosyserve.cli import main

main()
