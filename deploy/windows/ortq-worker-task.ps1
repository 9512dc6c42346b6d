<#
.SYNOPSIS
Runs one ortq worker for a scheduled task that install-ortq-workers.ps1 registered, and
restarts it by its exit status.

.DESCRIPTION
Task Scheduler restarts a task only when the task fails to start (its RestartOnFailure
setting), never because of an exit status, so this script is the task's action and does that
itself, by ortq's exit statuses (ortq/errors.py):
  0   stopped cleanly                     -> this script exits 0
  2   configuration error                 -> exits 2, no restart: fix it, then Start-ScheduledTask
  75  device lost (jobs went back)        -> restarts the worker at once
  any other status (a crash)              -> restarts after 5 s, doubling up to 5 min
The worker's output goes to the log file named in the configuration. This script joins a job
object that kills its processes when it ends, so Stop-ScheduledTask (which ends only this
process) does not leave the worker running. That stop is a hard kill: the job the worker was
running is taken back by the model's other workers (docs/reliability.md).

.PARAMETER ConfigPath
The JSON file install-ortq-workers.ps1 wrote: OrtqExe, Arguments, Environment, LogPath.
#>
param(
    [Parameter(Mandatory = $true)]
    [string] $ConfigPath
)

Set-StrictMode -Version Latest
$ErrorActionPreference = 'Stop'

$ExitConfiguration = 2
$ExitDeviceLost = 75
$LogRotateBytes = 64MB

Add-Type -TypeDefinition @'
using System;
using System.ComponentModel;
using System.Runtime.InteropServices;

public static class OrtqKillOnClose
{
    [StructLayout(LayoutKind.Sequential)]
    struct BasicLimits
    {
        public long PerProcessUserTimeLimit;
        public long PerJobUserTimeLimit;
        public uint LimitFlags;
        public UIntPtr MinimumWorkingSetSize;
        public UIntPtr MaximumWorkingSetSize;
        public uint ActiveProcessLimit;
        public UIntPtr Affinity;
        public uint PriorityClass;
        public uint SchedulingClass;
    }

    [StructLayout(LayoutKind.Sequential)]
    struct IoCounters
    {
        public ulong ReadOperationCount;
        public ulong WriteOperationCount;
        public ulong OtherOperationCount;
        public ulong ReadTransferCount;
        public ulong WriteTransferCount;
        public ulong OtherTransferCount;
    }

    [StructLayout(LayoutKind.Sequential)]
    struct ExtendedLimits
    {
        public BasicLimits Basic;
        public IoCounters Io;
        public UIntPtr ProcessMemoryLimit;
        public UIntPtr JobMemoryLimit;
        public UIntPtr PeakProcessMemoryUsed;
        public UIntPtr PeakJobMemoryUsed;
    }

    const int JobObjectExtendedLimitInformation = 9;
    const uint JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE = 0x2000;

    [DllImport("kernel32.dll", SetLastError = true, CharSet = CharSet.Unicode)]
    static extern IntPtr CreateJobObject(IntPtr attributes, string name);

    [DllImport("kernel32.dll", SetLastError = true)]
    static extern bool SetInformationJobObject(IntPtr job, int infoClass, ref ExtendedLimits info, int length);

    [DllImport("kernel32.dll", SetLastError = true)]
    static extern bool AssignProcessToJobObject(IntPtr job, IntPtr process);

    [DllImport("kernel32.dll")]
    static extern IntPtr GetCurrentProcess();

    // Never closed by hand: Windows closes it when this process ends, however it ends, and
    // KILL_ON_JOB_CLOSE then ends every process started from here (the worker included).
    static IntPtr job;

    public static void Join()
    {
        job = CreateJobObject(IntPtr.Zero, null);
        if (job == IntPtr.Zero) throw new Win32Exception();
        ExtendedLimits limits = new ExtendedLimits();
        limits.Basic.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE;
        if (!SetInformationJobObject(job, JobObjectExtendedLimitInformation, ref limits, Marshal.SizeOf(typeof(ExtendedLimits))))
            throw new Win32Exception();
        if (!AssignProcessToJobObject(job, GetCurrentProcess())) throw new Win32Exception();
    }
}
'@

$config = Get-Content -Raw -LiteralPath $ConfigPath | ConvertFrom-Json
$logPath = [string] $config.LogPath

function Write-SupervisorLog([string] $message) {
    Add-Content -LiteralPath $logPath -Value ('{0} supervisor: {1}' -f (Get-Date -Format o), $message)
}

[OrtqKillOnClose]::Join()
foreach ($variable in $config.Environment.PSObject.Properties) {
    [Environment]::SetEnvironmentVariable($variable.Name, [string] $variable.Value, 'Process')
}

# cmd.exe appends the worker's output to the log: Windows PowerShell 5.1 would turn every line a
# native program writes to stderr (all of Python's logging) into an error record.
$quotedArguments = @($config.Arguments | ForEach-Object { '"{0}"' -f $_ }) -join ' '
$commandLine = '/d /s /c ""{0}" {1} >> "{2}" 2>&1"' -f $config.OrtqExe, $quotedArguments, $logPath

$delaySeconds = 5
while ($true) {
    if ((Test-Path -LiteralPath $logPath) -and (Get-Item -LiteralPath $logPath).Length -gt $LogRotateBytes) {
        Move-Item -LiteralPath $logPath -Destination "$logPath.1" -Force
    }
    Write-SupervisorLog "starting: $($config.OrtqExe) $quotedArguments"
    $started = Get-Date
    $startInfo = New-Object System.Diagnostics.ProcessStartInfo
    $startInfo.FileName = Join-Path $env:SystemRoot 'System32\cmd.exe'
    $startInfo.Arguments = $commandLine
    $startInfo.UseShellExecute = $false
    $startInfo.CreateNoWindow = $true
    $process = [System.Diagnostics.Process]::Start($startInfo)
    $process.WaitForExit()
    $exitCode = $process.ExitCode
    $ran = (Get-Date) - $started

    if ($exitCode -eq 0) {
        Write-SupervisorLog 'the worker stopped cleanly (exit 0)'
        exit 0
    }
    if ($exitCode -eq $ExitConfiguration) {
        Write-SupervisorLog 'configuration error (exit 2): not restarting; fix it, then Start-ScheduledTask'
        exit $ExitConfiguration
    }
    if ($exitCode -eq $ExitDeviceLost) {
        Write-SupervisorLog 'the device was lost (exit 75): restarting now'
        continue
    }
    # A worker that ran for a while before crashing starts again from the shortest delay.
    if ($ran.TotalMinutes -ge 10) {
        $delaySeconds = 5
    }
    Write-SupervisorLog "the worker exited with $exitCode after $([int] $ran.TotalSeconds) s: restarting in $delaySeconds s"
    Start-Sleep -Seconds $delaySeconds
    $delaySeconds = [Math]::Min($delaySeconds * 2, 300)
}
